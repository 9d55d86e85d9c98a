"""Integrations of breakgraph with model libraries, importable as ``breakgraph.integrations.*``.

* :mod:`breakgraph.integrations.transformers`: HuggingFace causal LMs (prefill, continuous
  batching).

In a source checkout the integrations live in the repository's top-level ``integrations/``
folder; it is added to this package's ``__path__`` (see :mod:`breakgraph._layout`). Installed
wheels carry them inside this package.
"""

from .._layout import CHECKOUT_INTEGRATIONS_DIR as _CHECKOUT

if _CHECKOUT is not None and _CHECKOUT not in __path__:
    __path__.append(_CHECKOUT)
