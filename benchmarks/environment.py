"""Where and with what a benchmark ran: the one run-metadata record of every script's JSON.

Every benchmark script puts :func:`environment` into its JSON (``"meta"``) and adds its own
settings beside it, so the report's sources table and each section read the same keys:
``gpu`` (``None`` on the CPU, where ``cpu`` names the processor), ``cuda``, ``torch``,
``transformers`` (``None`` where it is not installed), ``python``, ``date``, ``host`` and
``argv``; ``attention_writes_in_place`` where the transformers integration imports.

Example::

    >>> from benchmarks.environment import environment
    >>> meta = environment(cuda=False)
    >>> meta["gpu"], sorted(k for k in ("torch", "date", "host", "cpu") if meta[k])
    (None, ['cpu', 'date', 'host', 'torch'])
"""

from __future__ import annotations

import platform
import sys
import time

import torch

__all__ = ["environment"]


def environment(cuda: bool) -> dict:
    """The run's metadata; ``cuda``: whether the run measures the GPU (its name and the CUDA
    version are recorded then)."""
    meta = {
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "argv": sys.argv[1:],
    }
    if cuda:
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    else:
        meta["gpu"] = None
        meta["cpu"] = platform.processor() or platform.machine()
    try:
        from breakgraph.integrations.transformers.attention import FLASH_WRITES_IN_PLACE

        meta["attention_writes_in_place"] = FLASH_WRITES_IN_PLACE
    except ImportError:
        pass
    return meta


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__
