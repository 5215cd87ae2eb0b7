"""Weights into the engine's pinned arena: from safetensors as ``from_pretrained`` maps them, drawn at random, or quantized as they load."""
