"""Diffusion data: image/video + caption datasets, the encoder cache, and flow-matching batches."""
