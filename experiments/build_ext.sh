#!/usr/bin/env bash
# Build the executor ring's C fast path in place (experiments/concordia_lab/executor/_ringfast*.so); without it
# ring.py runs its Python twin. Needs a C compiler and the Python headers.   PYTHON=python3 bash experiments/build_ext.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
"${CC:-cc}" -O2 -Wall -shared -fPIC -I"$inc" concordia_lab/executor/_ringfast.c -o "concordia_lab/executor/_ringfast$suffix"
PYTHONPATH="$PWD:../src" "$PY" -c 'from concordia_lab.executor import ring; print("ring fast path:", ring.fast_path_status())'
