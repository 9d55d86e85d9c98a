"""Backends: how a segment is captured and replayed.

* ``"cuda"``: each segment is a ``torch.cuda.CUDAGraph``; the real thing.
* ``"emulated"``: each segment records its aten operations on the CPU (or any
  device) and re-executes them on replay against the same tensor objects. It
  reproduces CUDA-graph semantics (frozen addresses, frozen Python decisions, no
  Python on replay) so that graph bugs show up on a laptop and in CI.

Every backend follows the contract written down in :mod:`breakgraph.backends.base`
(``Backend.open`` -> ``Session`` -> ``Segment``, the same ``replay()``/``reset()`` for every
segment).

The backend is chosen per capture: ``capture(g, backend="emulated")``, else the
environment variable ``BREAKGRAPH_BACKEND``, else ``"cuda"`` when a GPU is
available. Nothing falls back silently.

Example::

    >>> from breakgraph.backends import select_backend
    >>> select_backend("emulated").name
    'emulated'
"""

from __future__ import annotations

import os

import torch

from ..errors import BackendError
from .base import Backend

__all__ = ["select_backend", "BACKENDS"]

BACKENDS = ("cuda", "emulated")


def select_backend(name: str | None = None, who: str = "breakgraph.capture") -> Backend:
    """Return the backend object for ``name`` (or the environment's / the default one).
    ``who`` is the caller the errors name, and where they say to pass ``backend=``: a
    ``PrefillRunner`` built without a GPU told its user to pass it to ``capture()``."""
    chosen = name if name is not None else os.environ.get("BREAKGRAPH_BACKEND") or None
    if chosen is None:
        if not torch.cuda.is_available():
            call = "capture()" if who == "breakgraph.capture" else who
            raise BackendError(
                f"{who}: no CUDA device is available. To run the same graph "
                f"semantics on the CPU, pass backend='emulated' to {call} (or set the "
                "environment variable BREAKGRAPH_BACKEND=emulated)."
            )
        chosen = "cuda"
    if chosen == "cuda":
        if not torch.cuda.is_available():
            raise BackendError(
                f"{who}: backend 'cuda' was requested but no CUDA device is available; "
                "use backend='emulated' (or BREAKGRAPH_BACKEND=emulated) on machines without a GPU."
            )
        from .cuda import CUDA_BACKEND

        return CUDA_BACKEND
    if chosen == "emulated":
        from .emulated import EMULATED_BACKEND

        return EMULATED_BACKEND
    raise BackendError(f"{who}: unknown backend {chosen!r}; choose one of {BACKENDS}.")
