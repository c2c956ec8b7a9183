"""Tokens into a run: tokenizers and prepared datasets, and the samples each rank reads."""
