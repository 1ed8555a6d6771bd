#!/usr/bin/env bash
# Create the race's virtual environments, each peer in its own, never in the project's envs.
#
#   bash benchmarks/race/setup_peers.sh [DIR]        # default: $ZEPHON_RACE_VENVS or /work/peers
#
# Needs python3.11 on PATH and the free-threaded 3.14t interpreter (../shared/tools/provision-python314t.sh,
# default /opt/python3.14t/bin/python3.14t or $ZEPHON_PY314T). Existing venvs are kept.
# torch is installed as its own first step with the exact CPU pin (never a CUDA build);
# pillow-simd builds from source with AVX2 and is installed last (anything depending on pillow
# would put Pillow back over it).
set -euo pipefail
DIR=${1:-${ZEPHON_RACE_VENVS:-/work/peers}}
PY311=${PY311:-python3.11}
PY314T=${ZEPHON_PY314T:-/opt/python3.14t/bin/python3.14t}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$DIR"
cd "$DIR"

make() {  # make NAME PYTHON PIP-ARGS...
  local name=$1 py=$2
  shift 2
  if [ -x "$name/bin/python" ]; then echo "$name: exists"; return; fi
  "$py" -m venv "$name"
  "$name/bin/pip" install -q "$@"
  echo "$name: ready"
}

make grain311 "$PY311" grain numpy tokenizers pillow
make grainft314t "$PY314T" grain-free-threading numpy tokenizers pillow
make zephon020 "$PY311" zephon==0.2.0 transformers tokenizers pillow pyarrow
if [ ! -x torch311/bin/python ]; then
  "$PY311" -m venv torch311
  torch311/bin/pip install -q torch==2.13.0
  torch311/bin/pip install -q numpy tokenizers pillow
  echo "torch311: ready"
fi
for spec in "simd311:$PY311" "simd314t:$PY314T"; do
  name=${spec%%:*}; py=${spec#*:}
  if [ -x "$name/bin/python" ]; then echo "$name: exists"; continue; fi
  "$py" -m venv "$name"
  "$name/bin/pip" install -q numpy fsspec pyarrow tokenizers zstandard
  "$name/bin/pip" install -q --no-deps -e "$REPO"
  CC="cc -mavx2" "$name/bin/pip" install -q --no-deps --no-cache-dir --force-reinstall pillow-simd
  echo "$name: ready"
done
