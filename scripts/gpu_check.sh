#!/usr/bin/env bash
# The whole GPU check in one go: CUDA tests + benchmarks, a short summary at the end.
#   bash scripts/gpu_check.sh            # results under $OUT (device tool) or ./gpu-results
# Sections can be skipped: SKIP_TESTS=1, SKIP_OVERHEAD=1, SKIP_PREFILL=1; PREFILL_ARGS adds flags.
# RUN_SUITE=1 also runs the pytest-benchmark suite (tests/benchmarks) into $OUT/pytest-benchmark.json;
# carry .whl (breakable-cuda-graphs wheel, for the peer comparison) with the device call; fetch it
# first (git-ignored): python3 -m pip download --no-deps -d .whl breakable-cuda-graphs==0.1.0
set -u -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torch, transformers; print('gpu:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| transformers', transformers.__version__)"

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -rfEs tests 2>&1 | tee "$OUT/pytest.log" | tail -25 || status=1
fi
if [ -z "${SKIP_OVERHEAD:-}" ]; then
  python3 benchmarks/bench_overhead.py --out "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log" || status=1
fi
if [ -z "${SKIP_PREFILL:-}" ]; then
  python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" || status=1
fi

if [ -n "${RUN_SUITE:-}" ]; then
  python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/benchmarks --benchmark-only \
    --benchmark-json="$OUT/pytest-benchmark.json" 2>&1 | tail -5 | tee "$OUT/suite.log" || status=1
fi

echo "================ summary ================"
[ -f "$OUT/pytest.log" ] && echo "tests: $(tail -1 "$OUT/pytest.log")"
[ -f "$OUT/overhead.log" ] && tail -4 "$OUT/overhead.log" | cut -c1-120
[ -f "$OUT/prefill.log" ] && grep -E "^  (single|batch|compiled)|^[a-z].*params|MoE" "$OUT/prefill.log" | cut -c1-220
exit $status
