"""Helpers of the benchmark suite."""


def timed(benchmark, fn, rounds=30, warmup_rounds=5):
    """``benchmark.pedantic`` with a device synchronisation inside the timed callable."""
    import torch

    def run():
        fn()
        torch.cuda.synchronize()

    return benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=warmup_rounds)
