#!/usr/bin/env bash
# The whole GPU check in one go: CUDA tests + benchmarks, a short summary at the end.
#   bash scripts/gpu_check.sh            # results under $OUT (device tool) or ./gpu-results
# Sections can be skipped: SKIP_TESTS=1, SKIP_PREFILL=1, SKIP_CB=1, SKIP_OVERHEAD=1,
# SKIP_ANATOMY=1; TEST_ARGS replaces the test selection (default: the whole suite; e.g.
# "-m requires_cuda tests" for the CUDA tests only). Optional sections: RUN_INTERPLAY=1
# (breakgraph after torch.compile reduce-overhead: benchmarks/compile_interplay.py, about 3 min),
# RUN_BEFORE_AFTER=REV (per-break overhead of git revision REV against this tree, one process),
# RUN_CAPTURE=1 (PrefillRunner construction split by variant: benchmarks/capture_time.py, ~2 min;
# copy capture-time.json to docs/results/h200-capture-time-after.json), RUN_TRACE=1 (a CB profiler
# trace, async against sync: benchmarks/cb_trace.py, ~40 s; its folder goes to
# docs/results/h200-cb-trace-5.17/), RUN_DECODE_ATTENTION=1 (one layer's decode attention three
# ways, and paged_decode at every split count and block, launched and graph-replayed, on the CB
# shapes' heads and four held-out ones, plus the break path's split threshold:
# benchmarks/decode_attention.py, ~1.5 min; copy decode-attention.json to
# docs/results/h200-decode-attention-split.json), RUN_SPLIT=1 (paged_decode's split against the
# kernel before, in turn: bench_cb --variants breakgraph,breakgraph_unsplit on SPLIT_MODELS and
# a 16-prompt long-context workload, ~2.5 min; copy split.json and split-long.json to
# docs/results/h200-cb-split-*.json, see report_cb_decode.SPLIT_FILES), RUN_DECODE_GRAPHS=1 (pure-decode steps as one graph
# against a break per layer, in turn: bench_cb --variants breakgraph,breakgraph_breaks on
# DECODE_MODELS, 3 rounds, ~2 min, then cb_trace of both over pure-decode steps on llama-1b,
# ~25 s; copy decode-graphs.json to docs/results/h200-cb-decode-graphs-*.json, see
# report_cb_decode.DECODE_GRAPHS_FILES, and the trace folder to docs/results/h200-cb-trace-decode-graphs-*),
# RUN_COMPILED=1 (enable_continuous_batching(compile=True) against the default, in turn:
# bench_cb --variants breakgraph,breakgraph_compiled on COMPILED_MODELS, 3 rounds, ~2.5 min
# with the compiles, then cb_trace of both over pure-decode steps on qwen3-0.6b, ~45 s; copy
# compiled.json to docs/results/h200-cb-compiled-*.json, see report_cb_decode.COMPILED_FILES, and the
# trace folder to docs/results/h200-cb-trace-compiled-*),
# RUN_BLOCK_TABLE=1 (pure-decode steps through transformers' block table, in turn: bench_cb
# --variants breakgraph,breakgraph_tx_fill,breakgraph_lists,breakgraph_compiled on
# BLOCK_TABLE_MODELS, 3 rounds, ~3 min with the compiles, then cb_trace of breakgraph and
# breakgraph_compiled over pure-decode steps on qwen2.5-3b-12l, ~45 s; copy block-table.json to
# docs/results/h200-cb-block-table-*.json, see report_cb_decode.BLOCK_TABLE_FILES, and the trace
# folder to docs/results/h200-cb-trace-block-table-*),
# RUN_FILL_VIEWS=1 (the block-table fill before and after it kept its numpy views, on the
# server's host: benchmarks/fill_views_probe.py, ~10 s; carry .device/block_table_before.py,
# written here by git show d092991:integrations/transformers/block_table.py; copy fill-views.json
# to docs/results/h200-host-fill-views-probe.json),
# RUN_DECODE_FLOOR=1 (a pure-decode step's parts against its HBM floor: benchmarks/decode_gemm_probe.py,
# then bench_cb --variants breakgraph,breakgraph_compiled on three shapes with 100 prompts and
# with 32, ~4.5 min; copy decode-gemm.json to docs/results/h200-decode-gemm.json, floor.json to
# docs/results/h200-cb-floor-again-5.17.json and floor-32.json to h200-cb-floor-32-again-5.17.json
# (the run with 5.24 carried: -5.24), see report_decode_step.FLOOR_FILES; the earlier tree's
# are FLOOR_BEFORE_FILES),
# RUN_WARM_KERNELS=1 (the decode kernels compiled when a manager is created, against the code
# before: bench_cb --variants breakgraph and breakgraph_cold_kernels, each in a process with an
# empty Triton cache, then benchmarks/triton_first_call.py twice on one empty cache; copy
# cb-breakgraph.json to docs/results/h200-cb-warm-kernels.json, cb-breakgraph_cold_kernels.json
# to h200-cb-cold-kernels.json, first-call-{cold,disk}.json to h200-triton-first-call-*.json,
# see report_decode_step.WARM_KERNELS_FILES and FIRST_CALL_FILES; the runs after the split pair
# are WARM_KERNELS_PAIR_FILES and FIRST_CALL_PAIR_FILES),
# RUN_STRESS=N (the CUDA tests while N threads keep the GPU busy: BREAKGRAPH_TEST_BUSY_GPU=N,
# docs/testing.md, ~4-5 min with -n 4 (STRESS_ARGS replaces "-n 4 -m requires_cuda tests",
# STRESS_TIMEOUT 420 s); writes stress.log, stress-times.txt, its .timeline and its .failures; run it with
# SKIP_TESTS=1 SKIP_PREFILL=1 SKIP_CB=1 SKIP_OVERHEAD=1 SKIP_ANATOMY=1),
# RUN_FORWARD_PARTS=REV (breakgraph's forward of a pure-decode CB step, part by part on the host:
# benchmarks/decode_forward_probe.py, git revision REV (in /tmp/breakgraph-before-forward) and
# this tree, one process each in turn, ~25 s a process; writes forward-{before,now}-N.json, see
# report_decode_forward.FILES),
# RUN_CB_REGIONS=DIR (enable_continuous_batching(compile=True): the older checkout in DIR, e.g.
# `git archive 9b928ae` (the whole-model compile), against this tree (the compile by region),
# bench_cb llama3-8b-4l with 32 prompts and breakgraph_compiled, one process each with empty
# Triton and Inductor caches, ABBA, ~3.5 min; both trees' floors at this card's bandwidth
# (HBM_TBS overrides; an older bench_cb took an H200's unless told); writes
# cb-compile-regions-{now,before}-N.json; session 55's runs, one round each and without
# HBM_TBS, are docs/results/h100-cb-compile-regions-*.json, see
# report_compile_capture.CB_REGION_FILES),
# RUN_AUTOTUNE=1 (compile={"mode": "max-autotune-no-cudagraphs"} in CB against compile=True:
# decode_gemm_probe --autotune --rows 32 (the GEMMs alone, cuBLAS against Inductor's autotuned
# kernels, ~25 s), then bench_cb llama3-8b-4l, 32 prompts, breakgraph_autotuned and
# breakgraph_compiled taking turns A B B A A B, 3 rounds a process, empty Triton and Inductor
# caches, ~8 min (a call of its own; floors at the card's bandwidth); writes decode-gemm-autotune.json
# and cb-{autotuned,compiled}-N.json, N the side's turn: to docs/results/<card>-..., see
# report_compile_capture.AUTOTUNE_FILES),
# RUN_FLOOR_TURNS=DIR (the pure-decode step of llama3-8b-4l at 32 requests against its floor, both
# decoders, the older checkout in DIR (e.g. `mkdir .baseline && git archive 73533b7 | tar -x -C
# .baseline`, carried with the call) and this tree, one process each in turn, twice, ~4 min;
# writes floor-32-{now,before}-N.json: the check that the default decoder's
# slower steps in session 29's floor runs (docs/performance.md, "The forward's output part,
# split") were the host's and not StepOrder's or the one-gather fill's; run with the CUDA
# test test_cuda_pure_decode_forwards_never_synchronize; the second turn runs the trees in the
# other order, so that neither always goes first; session 30's runs are
# docs/results/h200-cb-floor-32-rerun-*.json, see report_decode_forward.FLOOR_RERUN_FILES and
# the page's "The flagged slowdown, run again"),
# RUN_FUZZ_CB=N (the continuous-batching differential fuzzer on the GPU: N scenarios from
# FUZZ_CB_START, default 2000, in 4 processes, each stopped after FUZZ_CB_TIMEOUT s, default
# 300; fp32 against generate() there; writes fuzz-cb.log, every scenario and its verdict),
# RUN_CUDNN_RAGGED=1 (cuDNN's plans keyed on rounded lengths, TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1,
# against the default: benchmarks/capture_time.py's cudnn_ragged variant, two turns ABBA, then
# bench_prefill on mistral-7b-4l and mixtral-1k-4l with the variable unset, set, set, unset, one
# process each, ~7 min: a call of its own; copy capture-ragged.json and prefill-ragged-*.json to
# docs/results/h200-capture-time-ragged.json and h200-prefill-ragged-{off,on,on-2,off-2}.json,
# see report_cudnn_ragged), RUN_DECODE_KERNELS=1 (a pure-decode step's device time kernel by
# kernel: cb_trace on llama3-8b-4l, 32 requests, both decoders, ~45 s; once per release, its
# folder to docs/results/h200-cb-trace-llama3-32-<release>/, see report_decode_kernels.RUNS),
# RUN_COMPILE_FALLBACK=1 (compile=True's eager fallback, a batch longer than the ladder, with
# the inputs before StepBuffers.wide_inputs and with it: benchmarks/compile_eager_fallback.py
# on mistral-7b-4l and llama-1b, separate, wide, wide, separate, one process each, ~5 min;
# compile-eager-fallback-*.json to docs/results/h200-compile-eager-fallback-*.json, see
# report_compile_fallback.GPU_FILES),
# RUN_SPLIT_AB=1 (paged_decode's kernels with a compile-time split count against one pair for
# every count, in turn, warm_up's compile first on an empty Triton cache:
# benchmarks/split_kernel_ab.py, ~70 s; carry .device/paged_decode_before.py, written here by
# git show 7a08655:integrations/transformers/paged_decode.py; copy split-ab.json to
# docs/results/h200-split-kernel-ab.json, see report_decode_step.SPLIT_AB_FILE),
# RUN_PREFILL_REPRO=1 (the prefill benchmark's last five families in one process, mistral-7b-4l
# last with its compile variants: where a 5.24 run's plain HF graph hit an illegal memory access
# before benchmarks/baselines.CapturedForward freed the cuBLAS workspaces before its capture;
# carry .whl with the 5.24 wheel; ~3 min; expect no "failed" line: see docs/performance.md,
# "Prefill on transformers 5.24.0"), RUN_HOST_PATH=DIR (prefill's per-call host path, this tree
# against an older checkout in DIR, e.g. `mkdir .baseline && git archive REV | tar -x -C .baseline`
# carried with the call; both orders, ~4 min; HOST_PATH_PIN="taskset -c 6" pins both to one core;
# copy host-path-{new,old}-first.json to docs/results/h200-prefill-host-path-upload-*.json, see
# report_prefill.UPLOAD_FILES). The tests also write test-times.txt (seconds per test, and the
# seconds of garbage collection inside it); for the page's test-suite section run the CUDA tests
# alone (TEST_ARGS="-n 4 -m requires_cuda tests", about 125 s, with the pytest-xdist and execnet
# wheels carried in .whl; without -n, one process, about 3.5 min) and, here, python -m benchmarks.suite_times
# --times test-times.txt --log pytest.log --timeline test-times.txt.timeline --label ... --out docs/results/h200-cuda-suite-times.json.
# Tensor parallelism needs 2 GPUs (kind nvidia-h200-x2): bash scripts/tp_check.sh (the TP
# tests, the example and the TP benchmark, with and without NCCL graph mixing).
# PREFILL_ARGS adds flags to the prefill benchmark (e.g. "--families llama-1b,mixtral-4l" or
# "--compile-families mistral-7b-4l,llama-1b --budget-s 400"; see python -m benchmarks.bench_prefill
# --help). Expected on an H200: prefill about 6-7 min (its --budget-s, 420 s by default, trims
# the compile work and then whole families if it falls behind; PREFILL_TIMEOUT, 480 s, stops
# it for good, keeping the families already written), overhead about 1 min, anatomy under 1 min,
# continuous batching about 6 min (see cb_bench below).
# The whole script does not fit one 10-minute device call: split it with the SKIP_ flags.
# Continuous batching alone, once per transformers release (one device call each, ~6.5 min):
#   bash scripts/gpu_check.sh cb_bench "$OUT/cb-5.17.json"   # the image's transformers (5.17)
#   bash scripts/gpu_check.sh cb_bench "$OUT/cb-5.24.json"   # carry .whl holding the 5.24 wheel:
#     mkdir -p .whl && cp ../wheels/transformers-5.24.0-py3-none-any.whl .whl/   (then carry .whl)
# (everything in a call that carries .whl runs on the wheels in it; the JSON records the
# transformers and torch versions). A release tried but not declared (5.25.0) needs its
# huggingface-hub beside it and hub kernels off (its from_pretrained kernelizes by default):
#   pip download -d .whl --no-deps transformers==5.25.0 huggingface-hub==2.4.0 httpx2 \
#     httpcore2 truststore hf-xet click anyio h11   (then: USE_HUB_KERNELS=0 bash scripts/gpu_check.sh ...) Then, here: cp cb-5.17.json docs/results/h200-cb.json,
# cp cb-5.24.json docs/results/h200-cb-5.24.json, python -m benchmarks.report (a later tree's rerun
# beside a committed release's run goes to docs/results/h200-cb-again-5.24.json: cb_report.AGAIN_FILE).
# RUN_SUITE=1 also runs the pytest-benchmark suite (tests/benchmarks) into
# $OUT/pytest-benchmark.json; carry .whl (breakable-cuda-graphs wheel, for the peer comparison)
# with the device call; fetch it first (git-ignored):
#   python3 -m pip download --no-deps -d .whl breakable-cuda-graphs==0.1.0
# The device tool returns at most 8 files: the default sections write pytest.log,
# test-times.txt, its .timeline, benchmarks.log, prefill-baselines.json, overhead.json,
# anatomy.json (7);
# RUN_SUITE adds 2, RUN_CAPTURE 1, RUN_TRACE 4, RUN_DECODE_ATTENTION 1, RUN_SPLIT 2, RUN_HOST_PATH 2,
# RUN_PREFILL_REPRO 1,
# RUN_DECODE_GRAPHS 4, RUN_BLOCK_TABLE 5, RUN_DECODE_FLOOR 3, RUN_FILL_VIEWS 1, RUN_WARM_KERNELS 4, RUN_SPLIT_AB 1, RUN_FORWARD_PARTS 4,
# RUN_FLOOR_TURNS 4, RUN_CB_REGIONS 4, RUN_AUTOTUNE 7, RUN_STRESS 4, RUN_CUDNN_RAGGED 5, RUN_DECODE_KERNELS 3,
# RUN_COMPILE_FALLBACK 5, RUN_SPLIT_THRESHOLD 1, RUN_HELD_OUT 2, RUN_HELD_OUT_MOE 2, RUN_FUZZ_CB 1,
# RUN_SLIDING 2, RUN_COMPILED_SLIDING 4,
# RUN_RELEASES 1 per wheel (skip other sections
# to make room).
# RUN_HELD_OUT=1 (continuous batching on the whole Llama-3-8B, 32 layers, a shape no CB default
# was tuned on: bench_cb's default workload with stock_sdpa, stock_graphs and breakgraph, then 32
# prompts with both decoders and stock_graphs, the floors at this card's bandwidth (3.35 TB/s on
# an H100), ~4.5 min; copy cb-llama3-8b.json and cb-llama3-8b-32.json to
# docs/results/<card>-cb-llama3-8b*.json, with .whl holding the 5.24 wheel to
# <card>-cb-llama3-8b-5.24.json and -32-5.24.json, see report_held_out.WHOLE_FILES),
# RUN_SLIDING=1 (models with sliding-window layers: breakgraph against the breaks and against
# transformers' own index lists, in turn, stock beside them: bench_cb --models gemma3-1b, then
# gpt-oss-20b-4l, ~8 min on 5.17, whose stock is slow there; copy the JSON to docs/results, see
# report_held_out.SLIDING_FILES)
# RUN_COMPILED_SLIDING=1 (compile=True on the sliding-window shapes: bench_cb gemma3-1b and
# gpt-oss-20b-4l with breakgraph and breakgraph_compiled in turn, then cb_trace gemma3-1b with
# 32 requests and both decoders, ~3 min; copy the JSON and the trace folder to
# docs/results/<card>-cb-compiled-*.json and <card>-cb-trace-gemma3-32-<release>/, see
# report_compile_capture.CB_FILES)
# RUN_HELD_OUT_MOE=1 (the same two runs on the whole Qwen3-30B-A3B, 48 layers, 128 experts
# top-8, 61 GB in bf16, ~4 min; copy cb-qwen3-30b-a3b*.json to docs/results/<card>-cb-qwen3-30b-a3b*.json,
# see report_held_out.WHOLE_MOE_FILES),
# RUN_SPLIT_THRESHOLD=1 (the break path's split threshold on a finer grid, picked and held-out
# shapes: decode_attention --threshold-only, ~45 s; copy decode-attention-threshold.json to
# docs/results/h200-decode-attention-threshold.json, see report_cb_decode.THRESHOLD_FILE),
# RUN_RELEASES=DIR (the CUDA tests that touch transformers, -m "requires_cuda and transformers",
# 4 workers, on each transformers wheel in DIR, e.g. the newest patch of each minor release of
# compat.TESTED_VERSIONS fetched with pip download --no-deps into .device/releases and carried;
# ~100 s a release; writes cuda-transformers-<wheel>.log; needs the pytest-xdist wheels in .whl).
# Then, here: copy the JSON to docs/results/h200-*.json (prefill-baselines.json ->
# h200-prefill-baselines.json) and run python -m benchmarks.report.
source "$(dirname "$0")/setup_device.sh"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torch, transformers; print('gpu:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| transformers', transformers.__version__)"
# this card's HBM bandwidth in TB/s (benchmarks.roofline.CARDS), for runs of an older tree whose
# bench_cb took an H200's whatever the card: both trees' floors then divide by the same
card_tbs() { python3 -c "import torch; from benchmarks import roofline; print(roofline.floor_peaks(None, None, torch.cuda.get_device_name())[0] / 1e12)"; }

# cb_bench OUTFILE: benchmarks/bench_cb.py (stock sdpa CB, stock CUDA graphs, breakgraph; six
# shapes) into OUTFILE on the transformers this call has; it prints its H200 estimate first
# (about 340 s) and skips a model that would end past --budget-s (360 s). CB_ARGS adds flags
# (e.g. "--models qwen2.5-3b-12l,llama3-8b-4l"); CB_TIMEOUT (540 s) stops it for good, keeping
# the models already written.
cb_bench() {
  # shellcheck disable=SC2086  # CB_ARGS is a list of flags
  timeout "${CB_TIMEOUT:-540}" python3 -m benchmarks.bench_cb --out "$1" ${CB_ARGS:-}
}
if [ "${1:-}" = cb_bench ]; then
  [ -n "${2:-}" ] || { echo "usage: bash scripts/gpu_check.sh cb_bench OUTFILE"; exit 2; }
  cb_bench "$2" 2>&1 | tee "${2%.json}.log"
  exit "${PIPESTATUS[0]}"
fi

status=0
LOG="$OUT/benchmarks.log"
start=$SECONDS
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086  # TEST_ARGS is a list of arguments
  # per-test times appended as each test ends (scripts/pytest_timing.py): a run cut by the
  # device tool's limit still says where its time went
  PYTHONPATH="scripts${PYTHONPATH:+:$PYTHONPATH}" PYTEST_TIMING_FILE="$OUT/test-times.txt" \
    timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -rfEs -p pytest_timing ${TEST_ARGS:-tests} 2>&1 \
    | tee "$OUT/pytest.log" | tail -25 || status=1
  echo "[tests: $((SECONDS - start)) s]"
fi
if [ -z "${SKIP_PREFILL:-}" ]; then
  t=$SECONDS
  # shellcheck disable=SC2086  # PREFILL_ARGS is a list of flags
  timeout "${PREFILL_TIMEOUT:-480}" python3 -m benchmarks.bench_prefill \
    --out "$OUT/prefill-baselines.json" ${PREFILL_ARGS:-} 2>&1 | tee -a "$LOG" || status=1
  echo "[prefill: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -z "${SKIP_CB:-}" ]; then
  t=$SECONDS
  cb_bench "$OUT/cb.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[continuous batching: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_BEFORE_AFTER:-}" ]; then
  t=$SECONDS
  rm -rf /tmp/breakgraph-before && mkdir -p /tmp/breakgraph-before
  if [ -d .probe/before/breakgraph ]; then cp -r .probe/before/breakgraph /tmp/breakgraph-before/
  else git archive "$RUN_BEFORE_AFTER" breakgraph | tar -x -C /tmp/breakgraph-before; fi
  python3 -m benchmarks.overhead_before_after --before /tmp/breakgraph-before \
    --out "$OUT/before-after.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[before/after: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_INTERPLAY:-}" ]; then
  t=$SECONDS
  timeout "${INTERPLAY_TIMEOUT:-400}" python3 -m benchmarks.compile_interplay --out "$OUT/interplay.json" \
    --scenarios "${INTERPLAY_SCENARIOS:-clear,plain,compiled}" 2>&1 | tee -a "$LOG" || status=1
  echo "[interplay: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -z "${SKIP_OVERHEAD:-}" ]; then
  t=$SECONDS
  python3 -m benchmarks.bench_overhead --out "$OUT/overhead.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[overhead: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -z "${SKIP_ANATOMY:-}" ]; then
  t=$SECONDS
  python3 -m benchmarks.break_anatomy --out "$OUT/anatomy.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[anatomy: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_CAPTURE:-}" ]; then  # construction time split: benchmarks/capture_time.py (~2 min)
  t=$SECONDS
  timeout 300 python3 -m benchmarks.capture_time --families "${CAPTURE_FAMILIES:-llama-1b,mistral-sw256-4l}" \
    --out "$OUT/capture-time.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[capture time: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_PREFILL_REPRO:-}" ]; then  # the plain HF graph's cuBLAS-workspace fault, again
  t=$SECONDS
  timeout 300 python3 -m benchmarks.bench_prefill --out "$OUT/prefill-repro.json" \
    --families mixtral-4l,qwen3-moe-8l,mistral-sw256-4l,mixtral-1k-4l,mistral-7b-4l \
    >/tmp/prefill-repro.log 2>&1 || status=1
  if grep -q "failed" /tmp/prefill-repro.log; then  # a variant failed: keep what it said
    grep -A3 "failed" /tmp/prefill-repro.log | tee -a "$LOG"
    status=1
  fi
  echo "[prefill repro: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_HOST_PATH:-}" ]; then  # prefill's host path, this tree against an older checkout
  t=$SECONDS
  for order in new-first old-first; do  # both orders: the host's speed drifts between processes
    flag=""; [ "$order" = old-first ] && flag=--old-first
    # shellcheck disable=SC2086  # HOST_PATH_PIN is a command prefix, e.g. "taskset -c 6"
    timeout 300 ${HOST_PATH_PIN:-} python3 -m benchmarks.prefill_host_path --device cuda --no-trace \
      --families mistral-sw256-4l,mixtral-1k-4l --compare "$RUN_HOST_PATH" $flag \
      --out "/tmp/host-path-$order" 2>&1 | tail -40 | tee -a "$LOG" || status=1
    cp "/tmp/host-path-$order/host-path.json" "$OUT/host-path-$order.json" || status=1
  done
  echo "[host path: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_TRACE:-}" ]; then  # does async CB preparation overlap the device (~40 s)
  t=$SECONDS
  timeout 200 python3 -m benchmarks.cb_trace --model "${TRACE_MODEL:-mixtral-1k-8l}" \
    --out "$OUT/cb-trace" 2>&1 | tee -a "$LOG" || status=1
  echo "[cb trace: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_CUDNN_RAGGED:-}" ]; then  # cuDNN's rounded-length plans: capture and prefill (~7 min)
  t=$SECONDS
  timeout 300 python3 -m benchmarks.capture_time --families mistral-7b-4l,llama-1b \
    --variants default,cudnn_ragged --turns 2 --out "$OUT/capture-ragged.json" 2>&1 \
    | tee -a "$LOG" || status=1
  for setting in off on on-2 off-2; do  # PyTorch reads the variable once per process
    ragged=(); [ "${setting%-2}" = on ] && ragged=(env TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1)
    timeout 120 "${ragged[@]}" python3 -m benchmarks.bench_prefill \
      --families mistral-7b-4l,mixtral-1k-4l --compile-families "" --rounds 6 --budget-s 90 \
      --out "$OUT/prefill-ragged-$setting.json" >"/tmp/prefill-ragged-$setting.log" 2>&1 || status=1
  done
  echo "[cudnn ragged: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_DECODE_KERNELS:-}" ]; then  # a pure-decode step's device time, kernel by kernel (~45 s)
  t=$SECONDS
  timeout 200 python3 -m benchmarks.cb_trace --model llama3-8b-4l \
    --variants breakgraph,breakgraph_compiled --prompts 32 --max-len 1024 --new-tokens 128 \
    --skip 30 --steps 16 --settle 2 --out "$OUT/cb-trace-llama3-32" 2>&1 | tee -a "$LOG" || status=1
  echo "[decode kernels: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_COMPILE_FALLBACK:-}" ]; then  # compile=True's eager fallback, in turn (~5 min)
  t=$SECONDS
  turn=0
  for variant in separate wide wide separate; do  # ABBA: a process each (Dynamo's caches)
    turn=$((turn + 1))
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout 230 \
      python3 -m benchmarks.compile_eager_fallback --variant $variant \
      --out "$OUT/compile-eager-fallback-$variant-$turn.json" 2>&1 | tee -a "$LOG" || status=1
  done
  echo "[compile fallback: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_DECODE_ATTENTION:-}" ]; then  # one layer's decode attention, three ways (~40 s)
  t=$SECONDS
  timeout 200 python3 -m benchmarks.decode_attention --out "$OUT/decode-attention.json" 2>&1 \
    | tee -a "$LOG" || status=1
  echo "[decode attention: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_SPLIT_THRESHOLD:-}" ]; then  # the break path's split threshold, finer (~45 s)
  t=$SECONDS
  timeout 240 python3 -m benchmarks.decode_attention --threshold-only \
    --lengths 3072,3584,4096,4608,5120,5632,6144,7168,8192 \
    --out "$OUT/decode-attention-threshold.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[split threshold: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_HELD_OUT:-}" ]; then  # CB on the whole Llama-3-8B, held out (~4.5 min)
  t=$SECONDS
  timeout 150 python3 -m benchmarks.bench_cb --models llama3-8b --num-blocks 512 \
    --variants breakgraph,stock_sdpa,stock_graphs --repeat breakgraph --rounds 3 --budget-s 0 \
    --keep-going --out "$OUT/cb-llama3-8b.json" 2>&1 | tee -a "$LOG" || status=1
  v=breakgraph,breakgraph_compiled
  timeout 200 python3 -m benchmarks.bench_cb --models llama3-8b --num-blocks 512 --prompts 32 \
    --variants $v,stock_graphs --repeat $v --rounds 3 --budget-s 0 --keep-going \
    --out "$OUT/cb-llama3-8b-32.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[held out: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_HELD_OUT_MOE:-}" ]; then  # CB on the whole Qwen3-30B-A3B, held out (~4 min)
  t=$SECONDS  # 61 GB of weights: 384 blocks of KV cache keep it within an 80 GB card
  timeout 270 python3 -m benchmarks.bench_cb --models qwen3-30b-a3b --num-blocks 384 \
    --variants breakgraph,stock_sdpa,stock_graphs --repeat breakgraph --rounds 3 --budget-s 0 \
    --keep-going --out "$OUT/cb-qwen3-30b-a3b.json" 2>&1 | tee -a "$LOG" || status=1
  v=breakgraph,breakgraph_compiled
  timeout 270 python3 -m benchmarks.bench_cb --models qwen3-30b-a3b --num-blocks 384 --prompts 32 \
    --variants $v,stock_graphs --repeat $v --rounds 3 --budget-s 0 --keep-going \
    --out "$OUT/cb-qwen3-30b-a3b-32.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[held out, MoE: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_SLIDING:-}" ]; then  # sliding-window models, held out (~8 min)
  t=$SECONDS  # one process and JSON per model; copy them to docs/results/<card>-cb-sliding-*
  card=h200; case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H100*) card=h100 ;; esac
  for model in gemma3-1b gpt-oss-20b-4l; do
    timeout 300 python3 -m benchmarks.bench_cb --models $model \
      --repeat breakgraph,breakgraph_breaks,breakgraph_tx_rows \
      --rounds 3 --budget-s 0 --keep-going \
      --out "$OUT/$card-cb-sliding-$model-5.17.json" 2>&1 | tee -a "$LOG" || status=1
  done
  echo "[sliding: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_COMPILED_SLIDING:-}" ]; then  # compile=True on the sliding shapes (~3 min)
  t=$SECONDS
  card=h200; case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H100*) card=h100 ;; esac
  for model in gemma3-1b gpt-oss-20b-4l; do
    timeout 240 python3 -m benchmarks.bench_cb --models $model \
      --variants breakgraph,breakgraph_compiled --repeat breakgraph,breakgraph_compiled \
      --rounds 3 --budget-s 0 --keep-going \
      --out "$OUT/$card-cb-compiled-$model-5.17.json" 2>&1 | tee -a "$LOG" || status=1
  done
  timeout 200 python3 -m benchmarks.cb_trace --model gemma3-1b \
    --variants breakgraph,breakgraph_compiled --prompts 32 --max-len 1024 --new-tokens 128 \
    --skip 30 --steps 16 --settle 2 --out "$OUT/$card-cb-trace-gemma3-32-5.17" 2>&1 \
    | tee -a "$LOG" || status=1
  echo "[compiled sliding: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_RELEASES:-}" ]; then  # the CUDA transformers tests on each release's wheel
  for wheel in "$RUN_RELEASES"/transformers-*.whl; do
    t=$SECONDS
    name=$(basename "$wheel" .whl)
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel"
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python3 -m pytest -q -rfEs -n 4 \
      -p no:cacheprovider -m "requires_cuda and transformers" tests > "$OUT/cuda-$name.log" 2>&1 \
      || status=1
    echo "[$name: $((SECONDS - t)) s] $(tail -1 "$OUT/cuda-$name.log")" | tee -a "$LOG"
  done
fi
if [ -n "${RUN_DECODE_GRAPHS:-}" ]; then  # decode graphs against breaks, in turn (~2.5 min)
  t=$SECONDS
  timeout 300 python3 -m benchmarks.bench_cb --models "${DECODE_MODELS:-llama-1b,qwen2.5-3b-12l,mixtral-1k-8l}" \
    --variants breakgraph,breakgraph_breaks --repeat breakgraph,breakgraph_breaks --rounds 3 \
    --budget-s 0 --out "$OUT/decode-graphs.json" 2>&1 | tee -a "$LOG" || status=1
  timeout 100 python3 -m benchmarks.cb_trace --model llama-1b --variants breakgraph,breakgraph_breaks \
    --prompts 100 --max-len 1024 --new-tokens 128 --skip 70 --steps 16 --settle 2 \
    --out "$OUT/trace-decode-graphs" 2>&1 | tee -a "$LOG" || status=1
  echo "[decode graphs: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_COMPILED:-}" ]; then  # the decoder under torch.compile against the default (~3 min)
  t=$SECONDS
  timeout 300 python3 -m benchmarks.bench_cb \
    --models "${COMPILED_MODELS:-qwen3-0.6b,qwen2.5-3b-12l,llama3-8b-4l,mixtral-1k-8l}" \
    --variants breakgraph,breakgraph_compiled --repeat breakgraph,breakgraph_compiled --rounds 3 \
    --budget-s 0 --keep-going --out "$OUT/compiled.json" 2>&1 | tee -a "$LOG" || status=1
  timeout 130 python3 -m benchmarks.cb_trace --model qwen3-0.6b --variants breakgraph,breakgraph_compiled \
    --prompts 100 --max-len 1024 --new-tokens 128 --skip 70 --steps 16 --settle 2 \
    --out "$OUT/trace-compiled" 2>&1 | tee -a "$LOG" || status=1
  echo "[compiled decoder: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_BLOCK_TABLE:-}" ]; then  # block-table decode steps: numpy fill, lists, compiled (~4 min)
  t=$SECONDS
  v=breakgraph,breakgraph_tx_fill,breakgraph_lists,breakgraph_compiled
  timeout 330 python3 -m benchmarks.bench_cb --models "${BLOCK_TABLE_MODELS:-qwen2.5-3b-12l,llama3-8b-4l,mixtral-1k-8l}" \
    --variants "$v" --repeat "$v" --rounds 3 --budget-s 0 --keep-going \
    --out "$OUT/block-table.json" 2>&1 | tee -a "$LOG" || status=1
  timeout 130 python3 -m benchmarks.cb_trace --model qwen2.5-3b-12l --variants breakgraph,breakgraph_compiled \
    --prompts 100 --max-len 1024 --new-tokens 128 --skip 70 --steps 16 --settle 2 \
    --out "$OUT/trace-block-table" 2>&1 | tee -a "$LOG" || status=1
  echo "[block table: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_DECODE_FLOOR:-}" ]; then  # a pure-decode step's parts against its floor (~4.5 min)
  t=$SECONDS
  timeout 90 python3 -m benchmarks.decode_gemm_probe --out "$OUT/decode-gemm.json" 2>&1 | tee -a "$LOG" || status=1
  v=breakgraph,breakgraph_compiled
  timeout 200 python3 -m benchmarks.bench_cb --models qwen2.5-3b-12l,llama3-8b-4l,mixtral-1k-8l \
    --variants "$v" --repeat "$v" --rounds 3 --budget-s 0 --keep-going \
    --out "$OUT/floor.json" 2>&1 | tee -a "$LOG" || status=1
  timeout 170 python3 -m benchmarks.bench_cb --models qwen2.5-3b-12l,llama3-8b-4l,mixtral-1k-8l \
    --prompts 32 --variants "$v" --repeat "$v" --rounds 3 --budget-s 0 --keep-going \
    --out "$OUT/floor-32.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[decode floor: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_WARM_KERNELS:-}" ]; then  # decode kernels compiled at the manager's creation (~3.5 min)
  t=$SECONDS
  for v in breakgraph breakgraph_cold_kernels; do  # a process each, an empty Triton cache each
    TRITON_CACHE_DIR=$(mktemp -d) timeout 110 python3 -m benchmarks.bench_cb \
      --models llama3-8b-4l,qwen2.5-3b-12l --variants $v --repeat $v --rounds 3 --budget-s 0 \
      --keep-going --out "$OUT/cb-$v.json" 2>&1 | tee -a "$LOG" || status=1
  done
  cache=$(mktemp -d)
  for label in cold disk; do  # the same empty cache: compiled, then found on disk
    TRITON_CACHE_DIR=$cache timeout 100 python3 -m benchmarks.triton_first_call --label $label \
      --out "$OUT/first-call-$label.json" 2>&1 | head -1 | tee -a "$LOG" || status=1
  done
  echo "[warm kernels: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_SPLIT_AB:-}" ]; then  # one split pair against a pair per split count (~70 s)
  # carry .device/paged_decode_before.py (git show 7a08655:integrations/transformers/paged_decode.py)
  TRITON_CACHE_DIR=$(mktemp -d) timeout 200 python3 -m benchmarks.split_kernel_ab \
    --before .device/paged_decode_before.py --out "$OUT/split-ab.json" 2>&1 | tail -4 | tee -a "$LOG" || status=1
fi
if [ -n "${RUN_FILL_VIEWS:-}" ]; then  # the block-table fill's own cost, this host (~10 s)
  # carry .device/block_table_before.py (git show d092991:integrations/transformers/block_table.py)
  timeout 60 python3 -m benchmarks.fill_views_probe --before d092991 \
    --before-file .device/block_table_before.py --out "$OUT/fill-views.json" 2>&1 | tee -a "$LOG" || status=1
fi
if [ -n "${RUN_SPLIT:-}" ]; then  # paged_decode's split against the kernel before, in turn (~2.5 min)
  t=$SECONDS
  timeout 200 python3 -m benchmarks.bench_cb --models "${SPLIT_MODELS:-qwen3-0.6b,mixtral-1k-8l,qwen2.5-3b-12l,llama3-8b-4l}" \
    --variants breakgraph,breakgraph_unsplit --repeat breakgraph,breakgraph_unsplit --rounds 3 \
    --budget-s 0 --keep-going --out "$OUT/split.json" 2>&1 | tee -a "$LOG" || status=1
  timeout 150 python3 -m benchmarks.bench_cb --models qwen2.5-3b-12l,llama3-8b-4l --prompts 16 \
    --min-len 4096 --max-len 12288 --new-tokens 64 --cold-new-tokens 8 \
    --variants breakgraph,breakgraph_unsplit --repeat breakgraph,breakgraph_unsplit --rounds 3 \
    --budget-s 0 --keep-going --out "$OUT/split-long.json" 2>&1 | tee -a "$LOG" || status=1
  echo "[decode split: $((SECONDS - t)) s]" | tee -a "$LOG"
fi
if [ -n "${RUN_STRESS:-}" ]; then  # the CUDA tests under a busy GPU (docs/testing.md; ~4-5 min with -n 4)
  # -n 4 needs pytest-xdist and execnet (not in the device image): carry their wheels in .whl,
  # which this script installs (pip download --no-deps -d .whl pytest-xdist execnet), or set STRESS_ARGS
  t=$SECONDS
  # shellcheck disable=SC2086  # STRESS_ARGS is a list of arguments
  BREAKGRAPH_TEST_BUSY_GPU=${RUN_STRESS} PYTHONPATH="scripts${PYTHONPATH:+:$PYTHONPATH}" \
    PYTEST_TIMING_FILE="$OUT/stress-times.txt" timeout -k 10 "${STRESS_TIMEOUT:-420}" \
    python3 -m pytest -q -rfEsxX -p pytest_timing -p no:cacheprovider ${STRESS_ARGS:--n 4 -m requires_cuda tests} \
    > "$OUT/stress.log" 2>&1 || status=1
  echo "[stress: $((SECONDS - t)) s] $(tail -1 "$OUT/stress.log")" | tee -a "$LOG"
fi
if [ -n "${RUN_FUZZ_CB:-}" ]; then  # the CB differential fuzzer on the GPU: N seeds in 4 processes
  t=$SECONDS
  per=$(( (RUN_FUZZ_CB + 3) / 4 ))
  for k in 0 1 2 3; do
    BREAKGRAPH_FUZZ_CB_DEVICE=cuda timeout -k 10 "${FUZZ_CB_TIMEOUT:-300}" \
      python3 -m tests.test_fuzz_cb $(( ${FUZZ_CB_START:-2000} + k * per )) "$per" \
      > "$OUT/fuzz-cb-$k.log" 2>&1 &
  done
  wait
  cat "$OUT"/fuzz-cb-?.log > "$OUT/fuzz-cb.log" && rm -f "$OUT"/fuzz-cb-?.log
  grep -q "^seed.*FAIL" "$OUT/fuzz-cb.log" && status=1
  echo "[fuzz cb: $((SECONDS - t)) s] $(grep -c '^seed' "$OUT/fuzz-cb.log") seeds, $(grep -c '^seed.*FAIL' "$OUT/fuzz-cb.log") failed" | tee -a "$LOG"
fi
if [ -n "${RUN_FORWARD_PARTS:-}" ]; then  # the decode forward's host parts, REV against this tree
  before=/tmp/breakgraph-before-forward
  rm -rf "$before" && mkdir -p "$before"
  git archive "$RUN_FORWARD_PARTS" breakgraph integrations pyproject.toml | tar -x -C "$before"
  for turn in 1 2; do
    for tree in now before; do
      first=""; [ "$tree" = before ] && first="sys.path.insert(0, '$before'); "
      timeout 150 python3 -c "import sys; ${first}from benchmarks.decode_forward_probe import main; sys.exit(main())" \
        --passes 2 --out "$OUT/forward-$tree-$turn.json" 2>&1 | grep -E "^(llama|qwen)" | sed "s/^/[$tree $turn] /" \
        | tee -a "$LOG" || status=1
    done
  done
fi
if [ -n "${RUN_FLOOR_TURNS:-}" ]; then  # the pure-decode step at 32 requests, DIR against this tree (~4 min)
  before=$(cd "$RUN_FLOOR_TURNS" && pwd)
  v=breakgraph,breakgraph_compiled
  tbs=${HBM_TBS:-$(card_tbs)}
  for turn in 1 2; do
    order="now before"; [ "$turn" = 2 ] && order="before now"  # ABBA: neither tree always goes first
    for tree in $order; do
      first=""; [ "$tree" = before ] && first="sys.path.insert(0, '$before'); "
      timeout 100 python3 -c "import sys; ${first}from benchmarks.bench_cb import main; main()" \
        --models llama3-8b-4l --prompts 32 --variants $v --repeat $v --rounds 3 --budget-s 0 \
        --keep-going --hbm-tbs "$tbs" --out "$OUT/floor-32-$tree-$turn.json" > /dev/null 2>&1 || status=1
      echo "[floor $tree $turn: $(python3 -c "import json, sys; m = json.load(open(sys.argv[1]))['models'][0]; print(', '.join(f\"{k} {v['decode_step_ms']:.2f} ms ({v['decode_over_floor']:.2f}x)\" for k, v in m['variants'].items()))" "$OUT/floor-32-$tree-$turn.json")]" | tee -a "$LOG"
    done
  done
fi
if [ -n "${RUN_CB_REGIONS:-}" ]; then  # compile=True in CB, DIR's compile against this tree's (~3.5 min)
  before=$(cd "$RUN_CB_REGIONS" && pwd)
  tbs=${HBM_TBS:-$(card_tbs)}
  for turn in 1 2; do
    order="now before"; [ "$turn" = 2 ] && order="before now"  # ABBA
    for tree in $order; do
      first=""; [ "$tree" = before ] && first="sys.path.insert(0, '$before'); "
      # a cold start each: empty Triton and Inductor caches, Inductor's and AOT autograd's off
      TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 timeout 170 \
        python3 -c "import sys; ${first}from benchmarks.bench_cb import main; main()" \
        --models llama3-8b-4l --prompts 32 --variants breakgraph_compiled \
        --repeat breakgraph_compiled --rounds 3 \
        --hbm-tbs "$tbs" --budget-s 0 --keep-going \
        --out "$OUT/cb-compile-regions-$tree-$turn.json" > /dev/null 2>&1 || status=1
      echo "[cb regions $tree $turn: $(python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['models'][0]['variants']['breakgraph_compiled']; print(f\"first manager {e['rounds_manager_s'][0]:.1f} s, decode {e['decode_step_ms']:.2f} ms\")" "$OUT/cb-compile-regions-$tree-$turn.json")]" | tee -a "$LOG"
    done
  done
fi
if [ -n "${RUN_AUTOTUNE:-}" ]; then  # Inductor's max-autotune in CB against compile=True
  timeout 130 python3 -m benchmarks.decode_gemm_probe --autotune --rows 32 \
    ${HBM_TBS:+--hbm-tbs $HBM_TBS} --out "$OUT/decode-gemm-autotune.json" > /dev/null 2>&1 || status=1
  declare -A turns=([autotuned]=0 [compiled]=0)
  for variant in autotuned compiled compiled autotuned autotuned compiled; do  # ABBAAB
    turns[$variant]=$((turns[$variant] + 1)); turn=${turns[$variant]}
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout 210 \
      python3 -m benchmarks.bench_cb --models llama3-8b-4l --prompts 32 \
      --variants "breakgraph_$variant" --repeat "breakgraph_$variant" --rounds 3 \
      ${HBM_TBS:+--hbm-tbs $HBM_TBS} --budget-s 0 --keep-going \
      --out "$OUT/cb-$variant-$turn.json" > /dev/null 2>&1 || status=1
    echo "[autotune $variant $turn: $(python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['models'][0]['variants']['breakgraph_$variant']; print(f\"first manager {e['rounds_manager_s'][0]:.1f} s, decode forward on the device {e['decode_forward_device_ms']:.2f} ms\")" "$OUT/cb-$variant-$turn.json")]" | tee -a "$LOG"
  done
fi
if [ -n "${RUN_SUITE:-}" ]; then
  python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/benchmarks --benchmark-only \
    --benchmark-json="$OUT/pytest-benchmark.json" > "$OUT/suite.log" 2>&1 || status=1
  tail -3 "$OUT/suite.log"
fi

echo "================ summary ($((SECONDS - start)) s) ================"
[ -f "$OUT/pytest.log" ] && echo "tests: $(tail -1 "$OUT/pytest.log")"
[ -f "$OUT/suite.log" ] && echo "suite: $(tail -1 "$OUT/suite.log")"
if [ -f "$LOG" ]; then
  sed -n '/^---- prefill summary ----$/,/^---- end of prefill summary ----$/p' "$LOG" | cut -c1-300
  grep -E "^(regime|tiny kernels|many kernels|large tensors)|breaks;|^ +tokens|^ +[0-9]+ +[0-9.]+ |^\[(prefill|overhead|anatomy|continuous|interplay|before)|^\{\"scenario" "$LOG" | cut -c1-240
fi
exit $status
