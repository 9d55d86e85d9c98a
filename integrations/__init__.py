"""Integrations of breakgraph with model libraries, importable as ``breakgraph.integrations.*``.

* :mod:`breakgraph.integrations.transformers`: prefill of HuggingFace causal LMs.
"""
