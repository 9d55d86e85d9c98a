#!/usr/bin/env bash
# The tensor-parallel check on 2 GPUs (device kind nvidia-h200-x2), results under $OUT:
#   bash scripts/tp_check.sh
# 1. the TP tests with NCCL and CUDA graphs (tests/test_tensor_parallel.py)  -> tp-pytest.log
# 2. the example under torchrun                                              -> tp-example.log
# 3. the benchmark (8B-Llama shape, graph mixing on: NCCL's default)         -> tp.json, tp-bench.log
# 4. the benchmark again with NCCL_GRAPH_MIXING_SUPPORT=0, if time is left   -> tp-no-mixing.json
# SKIP_TP_TESTS=1 / SKIP_TP_EXAMPLE=1 / SKIP_TP_BENCH=1 / SKIP_TP_NO_MIXING=1 skip a step;
# TP_EXTRA (any command) runs last, with the same logging and a 300 s limit.
# Then, here: copy tp.json to docs/results/h200x2-tp.json and run python -m benchmarks.report.
source "$(dirname "$0")/setup_device.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| NCCL', torch.cuda.nccl.version(), '| GPUs', torch.cuda.device_count())"
status=0
start=$SECONDS
step() {  # step NAME TIMEOUT LOG COMMAND...
  local name=$1 limit=$2 log=$3; shift 3
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
[ -n "${SKIP_TP_TESTS:-}" ] || step tests 500 "$OUT/tp-pytest.log" \
  python3 -m pytest -q -rs tests/test_tensor_parallel.py
[ -n "${SKIP_TP_EXAMPLE:-}" ] || step example 150 "$OUT/tp-example.log" \
  torchrun --nproc-per-node 2 examples/tensor_parallel.py
[ -n "${SKIP_TP_BENCH:-}" ] || step bench 330 "$OUT/tp-bench.log" \
  torchrun --nproc-per-node 2 -m benchmarks.bench_tp --out "$OUT/tp.json"
if [ -z "${SKIP_TP_NO_MIXING:-}" ] && [ $((SECONDS - start)) -lt 300 ]; then
  step bench-no-mixing 280 "$OUT/tp-no-mixing.log" \
    torchrun --nproc-per-node 2 -m benchmarks.bench_tp --no-graph-mixing --out "$OUT/tp-no-mixing.json"
fi
if [ -n "${TP_EXTRA:-}" ]; then
  step extra 300 "$OUT/tp-extra.log" bash -c "$TP_EXTRA"
fi
echo "total $((SECONDS - start)) s, status $status"
exit $status
