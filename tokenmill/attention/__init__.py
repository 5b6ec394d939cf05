"""Attention over the paged KV cache: the backend interface and its per-step metadata, the
torch/CPU backend, the Triton backend, latent attention (MLA) and a slow reference."""
