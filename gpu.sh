export PYTHONPATH=$PWD/src:$PYTHONPATH; PYTHON=python3 bash scripts/build_ext.sh || exit 1
# instr-sass: Compute Sanitizer block-entry patches on cuBLAS / eager kernels; the interposer's launch cut
mkdir -p $OUT/instr-sass
export CONCORDIA_CACHE_DIR=/tmp/cft-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
echo "compute-sanitizer: $CS"; [ -n "$CS" ] && "$CS" --version | tail -1
SAN=$(dirname "$(readlink -f "$CS")")
ls "$SAN" | tr '\n' ' '; echo
if [ -f "$SAN/include/sanitizer.h" ] && [ -f "$SAN/libsanitizer-public.so" ]; then export CONCORDIA_SANITIZER_HOME=$SAN; fi
echo "CONCORDIA_SANITIZER_HOME=$CONCORDIA_SANITIZER_HOME"
grep -m1 -o "SANITIZER_API_VERSION.*" "$SAN/include/sanitizer.h" 2>/dev/null
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
echo "CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}"
timeout 100 python3 benchmarks/bench_blockgate.py --out-dir $OUT/instr-sass --timeout 48 2>&1 | tail -c 9000
