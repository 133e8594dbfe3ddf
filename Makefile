# The few commands a newcomer needs. `make dev` once, then `make test`.
VENV ?= .venv
# The real-engine bed (vLLM's CPU build + a tiny model), built by e2e/build_bed.sh; see docs/e2e.md.
E2E_BED ?= $(abspath .e2e)
PY := $(VENV)/bin/python

.PHONY: dev build test test-rust lint fmt bench bench-peers e2e
dev:
	python3 -m venv $(VENV) && $(VENV)/bin/pip install -q maturin numpy pytest hypothesis pytest-benchmark
	VIRTUAL_ENV=$(VENV) $(VENV)/bin/maturin develop --release
build:
	VIRTUAL_ENV=$(VENV) $(VENV)/bin/maturin develop --release
test: test-rust
	$(PY) -m pytest
test-rust:
	cargo test -p kvroute-core -p kvroute-aisim
lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
fmt:
	cargo fmt --all
bench:
	$(PY) benches/compare_index.py
	cargo bench -p kvroute-core
bench-peers:
	$(VENV)/bin/pip install -q "ai-dynamo-runtime==1.6.1"
e2e:
	KVROUTE_E2E_BED=$(E2E_BED) e2e/build_bed.sh
	KVROUTE_E2E_BED=$(E2E_BED) KVROUTE_E2E_REQUIRED=1 $(E2E_BED)/venv/bin/python -m pytest tests/e2e
	# The integrations' fake-engine tests need litellm and ray, which only the bed has; a process of their
	# own, because LiteLLM keeps global state (callbacks, its logging worker) that the e2e LiteLLM tests leave behind.
	$(E2E_BED)/venv/bin/python -m pytest tests/test_integration_litellm.py tests/test_integration_ray.py
