"""HuggingFace transformers integration (see docs/integration-transformers.md)."""
