#!/usr/bin/env bash
# The GPU half of the project on one lent H200: GPU tests and the benchmarks, results stamped and written to
# ${OUT:-benchmarks/results}; the lab parts (executor, sm_share, instrument, interposer: scripts in experiments/)
# to ${OUT:-experiments/results}. The machine's image has torch/triton/cuda-bindings/transformers/peft but
# not crc32c: a crc32c wheel in .whl/ (ignored by git) is installed first when present.
#   bash benchmarks/run_h200.sh tests executor sm_share delta llm[:decode,recovery,lora] serve[:throughput,recovery] dist dist_bench instrument interposer graph_epochs
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
lab_out="${OUT:-experiments/results}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD/experiments:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PYTHON=python3 bash scripts/build_ext.sh || exit 1  # the ring's C fast path (the tree is used in place)
export CONCORDIA_RING_IMPL=c  # and it must be the one measured
rc=0
for part in "$@"; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case "$part" in
    tests) python3 -m pytest tests/gpu -q -p no:cacheprovider --durations=10 2>&1 | tail -40 ;;
    executor) python3 experiments/bench_executor.py --out-dir "$lab_out" 2>&1 | tail -60 ;;
    sm_share) python3 experiments/bench_sm_share.py --out-dir "$lab_out" 2>&1 | grep -v -i warn | tail -60 ;;
    delta) python3 benchmarks/bench_delta_gpu.py --out-dir "$out" 2>&1 | tail -40 ;;
    llm|llm:*) only="${part#llm}"; only="${only#:}"
       python3 benchmarks/bench_llm.py --out "$out" ${only:+--only "$only"} 2>&1 | tail -60 ;;
    graph_epochs) python3 benchmarks/bench_graph_epochs.py --out-dir "$out" ${GRAPH_EPOCHS_ARGS:-} 2>&1 | grep -v -i warn | tail -60 ;;
    dist) python3 -m pytest tests/gpu/test_distributed_nccl.py -q -p no:cacheprovider 2>&1 | tail -20 ;;
    dist_bench) python3 benchmarks/bench_distributed.py --backend nccl --world 2 --rounds 1 --kills 2 --gap 40 --modes hot,hot-build,restart \
         --out-dir "$out" 2>&1 | tail -30 ;;
    serve|serve:*) only="${part#serve}"; only="${only#:}"
       python3 benchmarks/bench_serve.py --out "$out" ${only:+--only "$only"} 2>&1 | grep -v -i warn | tail -40 ;;
    instrument) python3 -m pytest experiments/tests/gpu/test_instrument_pause_gpu.py experiments/tests/gpu/test_instrument_interposer_gpu.py -q -p no:cacheprovider 2>&1 | tail -30
       [ -n "${SKIP_PAUSE_BENCH:-}" ] || python3 experiments/bench_pause.py --out-dir "$lab_out" 2>&1 | tail -40 ;;
    interposer) python3 experiments/bench_interposer.py --out-dir "$lab_out" ${INTERPOSER_ARGS:-} 2>&1 | tail -40 ;;
    *) echo "unknown part $part"; rc=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
done
exit $rc
