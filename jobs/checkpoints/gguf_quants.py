"""The quant types a GGUF export writes, checked without torch (the service's API process checks them too)."""

from __future__ import annotations

# llama.cpp's spellings of the types this export writes: the gguf package's own (f32 to q8_0), and llama.cpp's
# Q4_K_M mix of Q4_K and Q6_K tensors (jobs/checkpoints/k_quants.py).
QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
# Made by llama.cpp's C++ quantizer from an f16 file (K-quants and kin, importance-weighted block formats
# the gguf package does not write): the message names the command.
LLAMA_QUANTIZE_TYPES = (
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_0",
    "q4_1",
    "q4_k_s",
    "q5_0",
    "q5_1",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
    "iq2_xxs",
    "iq2_xs",
    "iq3_xxs",
    "iq3_s",
    "iq4_nl",
    "iq4_xs",
)


def check_quant(quant: str) -> str:
    """The quant name lower-cased, or a ValueError naming the choices (and the command for K-quants).

    Example:
        >>> check_quant("Q4_K_M")
        'q4_k_m'
    """
    name = quant.strip().lower()
    if name in QUANTS:
        return name
    if name in LLAMA_QUANTIZE_TYPES:
        raise ValueError(
            f"quant {quant!r} is made by llama.cpp's quantizer, not by this export: export quant f16, then run "
            f"`llama-quantize model-f16.gguf model-{name}.gguf {name.upper()}` (llama.cpp's build/bin/llama-quantize)"
        )
    raise ValueError(f"unknown quant {quant!r}: choose one of {', '.join(QUANTS)}")
