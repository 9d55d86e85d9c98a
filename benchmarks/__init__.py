"""breakgraph's benchmarks and the generator of ``docs/performance.md``.

A package so that the scripts share code and tests import it (``benchmarks.report``)
without touching ``sys.path``. Run the scripts as modules from the repository root::

    python -m benchmarks.bench_prefill --smoke          # seconds, CPU, emulated backend
    python -m benchmarks.bench_prefill --out prefill.json   # the H200 run
    python -m benchmarks.bench_overhead --out overhead.json
    python -m benchmarks.break_anatomy --out anatomy.json
    python -m benchmarks.report                         # docs/results/*.json -> docs/performance.md

Modules: ``timing`` (turn-taking medians, host and device time), ``families`` (model
shapes), ``environment`` (the run metadata every script's JSON records), ``baselines`` (what a
user would otherwise run: HF eager, an exact-length CUDA graph, ``torch.compile``),
``one_graph`` (breakgraph's packed forward in one graph with no breaks: what the breaks cost),
``bench_prefill`` (the prefill comparison), ``bench_cb`` (continuous batching against stock
transformers; ``cb_instruments``: how it measures; ``roofline``: the device floor of a
workload; ``cb_trace``: a profiler trace of CB steps, whether async preparation overlaps the
device), ``prefill_host_path`` (one prefill call's host path, stage by stage), ``capture_time``
(where a runner's construction time goes), ``report`` and its ``performance.md.in`` template.
"""
