"""Quantized frozen weights (NF4, int8 through torchao): stored, streamed, and dequantized on arrival."""
