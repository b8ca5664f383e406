#!/usr/bin/env bash
# Build the C extensions in place (src/concordia_ft/...) for a tree used through PYTHONPATH=src rather than
# installed: `pip install -e .` does the same through setuptools. Needs a C compiler and the Python headers.
#   PYTHON=python3 bash scripts/build_ext.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
"${CC:-cc}" -O2 -Wall -shared -fPIC -pthread -I"$inc" src/concordia_ft/core/_slotlog.c -o "src/concordia_ft/core/_slotlog$suffix"
"${CC:-cc}" -O2 -Wall -shared -fPIC -I"$inc" src/concordia_ft/core/_ntcopy.c -o "src/concordia_ft/core/_ntcopy$suffix"
"$PY" -c 'import sys; sys.path.insert(0, "src"); from concordia_ft.core import slotlog; print("token-epoch writer:", slotlog.status())'
"$PY" -c 'import sys; sys.path.insert(0, "src"); from concordia_ft.core import streamed; print("streamed restore loop:", streamed.loop_status())'
