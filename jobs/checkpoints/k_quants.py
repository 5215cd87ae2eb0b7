"""The K-quant formats Q4_K and Q6_K written in numpy, and llama.cpp's ``Q4_K_M`` mix of them.

The ``gguf`` package reads these formats (``gguf.quants.dequantize``) but does not write them. The
quantizers here follow ggml's reference ones (``quantize_row_q4_K_ref``, ``quantize_row_q6_K_ref`` in
``ggml-quants.c``: no importance matrix) step by step, each super-block of 256 values at once across the
tensor instead of one after another; the sums run in another order than C's loop, so a rare rounding tie
may pick a neighbouring level. The mix is ``llama_tensor_get_type``'s for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``
(``src/llama-quant.cpp``) for the dense Llama-family models the GGUF export writes.

Example:
    >>> blocks = quantize_k(np.random.randn(4096, 4096).astype(np.float32), gguf.GGMLQuantizationType.Q4_K)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

QK_K = 256  # values in a K-quant super-block
_EPS = 1e-15  # ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this is all zero
_CHUNK = 1024  # super-blocks quantized at once: each temporary (1 MB) stays in cache; threads take chunks in turn


def quantize_k(data: np.ndarray, qtype: Any) -> np.ndarray:
    """``data`` (rows a multiple of 256 wide) as the bytes of Q4_K or Q6_K blocks, shaped as gguf writes them.

    Args:
        data: A float array whose last dimension is a multiple of :data:`QK_K`.
        qtype: ``gguf.GGMLQuantizationType.Q4_K`` or ``Q6_K``.

    Returns:
        ``uint8`` of shape ``(*data.shape[:-1], data.shape[-1] // 256 * block_bytes)``.
    """
    import gguf

    encode = {gguf.GGMLQuantizationType.Q4_K: _q4_k_blocks, gguf.GGMLQuantizationType.Q6_K: _q6_k_blocks}[qtype]
    if data.shape[-1] % QK_K:
        raise ValueError(f"a {qtype.name} row is a multiple of {QK_K} values wide; got shape {data.shape}")
    blocks = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, QK_K)
    chunks = [blocks[start : start + _CHUNK] for start in range(0, len(blocks), _CHUNK)]
    # numpy lets go of the GIL inside its loops: threads over chunks use every core for a large tensor.
    with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
        out = np.concatenate(list(pool.map(encode, chunks)))
    return out.reshape(*data.shape[:-1], -1)


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layers: int, *, has_output: bool) -> Any:
    """The GGML type llama.cpp's ``Q4_K_M`` gives the 2-D tensor ``name`` (GGUF names, numpy ``shape``).

    Q6_K for the output projection (the token embedding when it doubles as the output) and for the value
    projection and ``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth, and every
    third between); Q4_K for the rest. A row not a multiple of 256 wide falls back as llama.cpp's does
    (Q4_K to Q5_0, Q6_K to Q8_0; to F16 when not even 32 wide).
    """
    import gguf

    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    wanted = q4
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        wanted = q6 if shape[-1] % QK_K == 0 else gguf.GGMLQuantizationType.Q8_0
    elif ".attn_v." in name or ".ffn_down." in name:
        layer = int(name.split(".")[1])  # blk.N.<tensor>: dense models number the tensors by layer
        wanted = q6 if _use_more_bits(layer, n_layers) else q4
    if shape[-1] % QK_K == 0:
        return wanted
    fallback = {q4: gguf.GGMLQuantizationType.Q5_0, q6: gguf.GGMLQuantizationType.Q8_0}.get(wanted, wanted)
    return fallback if shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F16


def _use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _nearest(values: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even (its float trick); kept float32 for the sums that follow."""
    return np.rint(values).astype(np.float32, copy=False)


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _min_max_fit(x: np.ndarray, weights: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qkx2_quants(n, nmax, x, weights, ..., rmin=-1, rdelta=0.1, nstep=20, use_mad=false)`` per group.

    Each row of ``x`` is one group; returns its scale and minus its minimum. The search tries 21 scales
    around ``nmax / (max - min)`` and keeps the weighted least-squares fit of lowest weighted squared error,
    the group's minimum moving with each fit kept (as in C). The errors come from the sums the fit needs
    (``Σw(s·l + m - x)²`` expanded), not from another pass over the values. The levels themselves are not
    returned: Q4_K chooses them again against the stored 6-bit scales.
    """
    low, high = np.minimum(x.min(axis=1), 0), x.max(axis=1)
    flat = high == low
    span = np.where(flat, 1, high - low)
    weighted = weights * x
    sum_w, sum_x = np.einsum("ij->i", weights), np.einsum("ij->i", weighted)
    sum_xx = np.einsum("ij,ij->i", weighted, x)

    levels, weighted_levels = np.empty_like(x), np.empty_like(x)  # reused: no allocation per trial

    def sums(iscale: np.ndarray, origin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        np.subtract(x, origin[:, None], out=levels)
        np.multiply(levels, iscale[:, None], out=levels)
        np.rint(levels, out=levels)  # ggml's nearest_int: half to even
        np.clip(levels, 0, nmax, out=levels)
        np.multiply(weights, levels, out=weighted_levels)
        return (
            np.einsum("ij->i", weighted_levels),
            np.einsum("ij,ij->i", weighted_levels, levels),
            np.einsum("ij,ij->i", weighted_levels, x),
        )

    def error(scale: np.ndarray, low: np.ndarray, sum_l: np.ndarray, sum_l2: np.ndarray, sum_xl: np.ndarray) -> Any:
        return (
            scale * scale * sum_l2 + 2 * scale * low * sum_l - 2 * scale * sum_xl
            + low * low * sum_w - 2 * low * sum_x + sum_xx
        )  # fmt: skip

    iscale = (nmax / span).astype(np.float32)
    scale = 1 / iscale
    best = error(scale, low, *sums(iscale, low))
    for step in range(21):
        sum_l, sum_l2, sum_xl = sums((np.float32(nmax - 1.0 + 0.1 * step) / span).astype(np.float32), low)
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0  # a fit above zero: the minimum is pinned at 0, the scale refitted
            this_min = np.where(positive, 0, this_min)
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            trial = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (trial < best) & ~flat
        best = np.where(better, trial, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
        span = np.where(flat, 1, high - low)  # C divides by max - min with the minimum kept so far
    scale = np.where(flat, 0, scale)
    return scale.astype(np.float32), (-low).astype(np.float32)


def _q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_ref`` over ``[n, 256]``: 144 bytes a block (d, dmin, 12 bytes of 6-bit scales, nibbles)."""
    n = len(blocks)
    groups = blocks.reshape(n * 8, 32)
    weights = np.sqrt((groups * groups).mean(axis=1, keepdims=True)) + np.abs(groups)  # av_x + |x|
    scales, mins = _min_max_fit(groups, weights, 15)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, 63 / max_scale, 0).astype(np.float32)
        inv_min = np.where(max_min > 0, 63 / max_min, 0).astype(np.float32)
    ls = np.clip(_nearest(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(_nearest(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    packed = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    d, dmin = _fp16(max_scale / 63), _fp16(max_min / 63)
    # The levels are chosen again against the scales as stored (6-bit, times an f16): what a reader computes.
    step = d.astype(np.float32)[:, None] * ls.astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * lm.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = _nearest((blocks.reshape(n, 8, 32) + offset[..., None]) / step[..., None])
    levels = np.where(step[..., None] == 0, 0, np.clip(levels, 0, 15)).astype(np.uint8)
    pairs = levels.reshape(n, 4, 2, 32)  # each 64 values: the first 32 in the low nibbles, the next 32 high
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed, nibbles], 1)


def _symmetric_fit(x: np.ndarray, nmax: int) -> np.ndarray:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` per row: the scale of the x²-weighted best fit.

    Levels ``-nmax..nmax-1`` around the value of largest magnitude; 18 scales around ``nmax / max`` are tried.
    """
    rows = np.arange(len(x))
    peak = x[rows, np.abs(x).argmax(axis=1)]  # signed: the first value of largest magnitude
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, 1, peak)
    weights = x * x
    weighted = weights * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        levels = _nearest(iscale[:, None] * x)
        np.clip(levels, -nmax, nmax - 1, out=levels)
        return np.einsum("ij,ij->i", weighted, levels), np.einsum("ij,ij->i", weights * levels, levels)

    sum_lx, sum_l2 = fit(-nmax / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sum_l2 > 0, sum_lx / sum_l2, 0).astype(np.float32)
    best = scale * sum_lx
    for tweak in (*range(-9, 0), *range(1, 10)):
        sum_lx, sum_l2 = fit(-(nmax + np.float32(0.1) * tweak) / peak)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sum_lx / sum_l2, scale)
        best = np.where(better, scale * sum_lx, best)
    return np.where(zero, 0, scale).astype(np.float32)


def _q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q6_K_ref`` over ``[n, 256]``: 210 bytes a block (low nibbles, high 2 bits, 16 int8 scales, d)."""
    n = len(blocks)
    scales = _symmetric_fit(blocks.reshape(n * 16, 16), 32).reshape(n, 16)
    max_scale = scales[np.arange(n), np.abs(scales).argmax(axis=1)]
    zero = np.abs(max_scale) < _EPS  # the whole block is zero: written as zeros
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, 0, -128 / np.where(zero, 1, max_scale)).astype(np.float32)
        d = _fp16(np.where(zero, 0, 1 / np.where(zero, 1, iscale)))
    small = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)
    step = d.astype(np.float32)[:, None] * small.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = _nearest(blocks.reshape(n, 16, 16) / step[..., None])
    unused = (step == 0) | zero[:, None]  # a reader multiplies these by zero; C leaves a zero block all zeros
    levels = np.where(unused[..., None], 0, np.clip(levels, -32, 31) + 32).astype(np.uint8)
    quarters = levels.reshape(n, 2, 4, 32)  # per 128 values: four runs of 32
    low = quarters & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    high = quarters >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    small = np.where(zero[:, None], 0, small).astype(np.int8)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), small.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1
    )
