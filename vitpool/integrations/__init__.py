"""Integrations with other libraries: `vitpool.integrations.transformers` swaps a Hugging Face
model's vision tower for a pool (or an in-process GraphEncoder)."""
