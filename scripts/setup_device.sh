# Sourced by scripts/gpu_check.sh and scripts/tp_check.sh: strict mode, $OUT, unbuffered
# Python, and breakgraph installed (editable, no dependencies: the device image has them).
set -u -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/breakgraph-install.log 2>&1 \
  || { cat /tmp/breakgraph-install.log; exit 1; }
