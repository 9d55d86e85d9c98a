#!/usr/bin/env bash
# The whole GPU check in one go: CUDA tests + benchmarks, a short summary at the end.
#   bash scripts/gpu_check.sh            # results under $OUT (device tool) or ./gpu-results
# Sections can be skipped: SKIP_TESTS=1, SKIP_OVERHEAD=1, SKIP_PREFILL=1, SKIP_ANATOMY=1;
# PREFILL_ARGS adds flags (e.g. "--compile"). RUN_SUITE=1 also runs the pytest-benchmark suite
# (tests/benchmarks) into $OUT/pytest-benchmark.json; carry .whl (breakable-cuda-graphs wheel, for
# the peer comparison) with the device call; fetch it first (git-ignored):
#   python3 -m pip download --no-deps -d .whl breakable-cuda-graphs==0.1.0
# At most 7 files land in $OUT (the device tool returns 8): pytest.log, benchmarks.log,
# overhead.json, prefill.json, anatomy.json, pytest-benchmark.json, suite.log.
# Then, here: copy the JSON to docs/results/h200-*.json and run python benchmarks/report.py.
set -u -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/breakgraph-install.log 2>&1 \
  || { cat /tmp/breakgraph-install.log; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torch, transformers; print('gpu:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| transformers', transformers.__version__)"

status=0
LOG="$OUT/benchmarks.log"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -rfEs tests 2>&1 | tee "$OUT/pytest.log" | tail -25 || status=1
fi
if [ -z "${SKIP_OVERHEAD:-}" ]; then
  python3 benchmarks/bench_overhead.py --out "$OUT/overhead.json" 2>&1 | tee -a "$LOG" || status=1
fi
if [ -z "${SKIP_PREFILL:-}" ]; then
  python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" ${PREFILL_ARGS:-} 2>&1 | tee -a "$LOG" || status=1
fi
if [ -z "${SKIP_ANATOMY:-}" ]; then
  python3 benchmarks/break_anatomy.py --out "$OUT/anatomy.json" 2>&1 | tee -a "$LOG" || status=1
fi
if [ -n "${RUN_SUITE:-}" ]; then
  python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/benchmarks --benchmark-only \
    --benchmark-json="$OUT/pytest-benchmark.json" > "$OUT/suite.log" 2>&1 || status=1
  tail -3 "$OUT/suite.log"
fi

echo "================ summary ================"
[ -f "$OUT/pytest.log" ] && echo "tests: $(tail -1 "$OUT/pytest.log")"
[ -f "$OUT/suite.log" ] && echo "suite: $(tail -1 "$OUT/suite.log")"
[ -f "$LOG" ] && grep -E "^(regime|tiny|many|large)|^  (single|batch|compiled|host time)|^[a-z].*(params|breaks;)|^ +tokens|^MoE|^ +[0-9]+ +[0-9.]+ " "$LOG" | cut -c1-200
exit $status
