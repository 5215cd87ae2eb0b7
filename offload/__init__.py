"""Ferry's offload engine: train a model whose weights live on the CPU, streaming them to the device."""
