# The few commands a newcomer needs: `make dev` once, then `make test` and `make lint`.
# CI (.ci/run) is `make ci`: exactly these targets, in a fresh virtualenv.
VENV ?= .venv
# The real-engine bed (vLLM's CPU build + a tiny model), built by tests/e2e/build_bed.sh; see docs/e2e.md.
E2E_BED ?= $(abspath .bed)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CRATES := -p kvroute-core -p kvroute-dataplane -p kvroute-aisim

.PHONY: dev build test test-rust test-python test-aisim lint docs fmt bench bench-peers races e2e ci readme-test
dev:
	python3 -m venv $(VENV) && $(PIP) install -q maturin ".[test,lint]"
	VIRTUAL_ENV=$(VENV) $(VENV)/bin/maturin develop --release --features aisim
build:
	VIRTUAL_ENV=$(VENV) $(VENV)/bin/maturin develop --release --features aisim
test: test-rust test-python test-aisim
test-rust:
	cargo test -q $(CRATES)
test-python:
	$(PY) -m pytest
# The realistic engine model: the wheel built with the aisim feature (docs/simulator.md); leaves it installed.
test-aisim:
	MATURIN_PEP517_ARGS="--features aisim" $(PIP) install -q . && KVROUTE_REQUIRE_AISIM=1 $(PY) -m pytest -q tests/sim/test_aisim.py
# The documentation site (mkdocs.yml): guides, the generated CLI and Python API reference; --strict
# fails on a broken link or anchor.
docs:
	$(PIP) install -q mkdocs "mkdocstrings[python]"
	$(PY) -m mkdocs build --strict --quiet -d .ci/site
lint:
	cargo fmt --all --check
	cargo clippy -q --workspace --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches
	$(PY) -m ruff format --check python tests benches
	$(PY) -m mypy
	# The stub against the binary (as pydantic-core does); allowlist: what stubtest cannot see in a compiled module.
	$(PY) -m mypy.stubtest kvroute._core --allowlist .stubtest-allowlist
fmt:
	cargo fmt --all
	$(PY) -m ruff format python tests benches
bench:
	$(PY) benches/compare_index.py
	cargo bench -p kvroute-core
bench-peers:
	$(PIP) install -q "ai-dynamo-runtime==1.6.1"
e2e:
	KVROUTE_E2E_BED=$(E2E_BED) tests/e2e/build_bed.sh
	KVROUTE_E2E_BED=$(E2E_BED) KVROUTE_E2E_REQUIRED=1 $(E2E_BED)/venv/bin/python -m pytest tests/e2e
	# The integrations' fake-engine tests and docs/integrations.md's examples need litellm and ray, which only the
	# bed has; a process of their own, because LiteLLM keeps global state (callbacks, its logging worker) that the
	# e2e LiteLLM tests leave behind.
	$(E2E_BED)/venv/bin/python -m pytest tests/integrations/test_litellm.py tests/integrations/test_ray.py tests/docs/test_integrations_guide.py
# The benchmark harnesses with workspaces of their own under benches/ (Dynamo's crates are their peers, never
# the wheel's): each builds and runs a quick case. The AISimulate race's own tests (dynamo_shed places request for
# request as dynamo-mocker's KvRouterPlacement; its shedding), then it reruns one case of the committed suite and
# fails when its figures moved (the README renders that suite), and checks the two harnesses' round robin at every
# arrival instant.
races:
	cargo test --release -q --manifest-path benches/aisim_race/Cargo.toml
	$(PY) benches/bench_aisim.py --check
	$(PY) benches/index_race.py --quick --out .ci/index_race_quick.json
# The README's test command, verbatim, in a fresh virtualenv (keep identical to the README's second set-up command).
readme-test:
	rm -rf $(VENV) && python3 -m venv $(VENV)
	. $(VENV)/bin/activate && pip install ".[test]" && python -m pytest
# The lint tools only (`pip install ".[lint]"` would rebuild kvroute without the aisim feature stubtest checks).
ci: test-rust readme-test test-aisim
	$(PIP) install -q ruff mypy
	$(MAKE) lint
	$(MAKE) docs
	$(MAKE) races
	$(MAKE) e2e
