"""Q4_K and Q6_K as ggml writes them: gguf's own dequantizer reads Ferry's blocks back within the format's
error, they equal a line-by-line transcription of ggml's reference quantizers, and the Q4_K_M mix is
llama.cpp's."""

from __future__ import annotations

import numpy as np
import pytest

from jobs.checkpoints.k_quants import q4_k_m_type, quantize_k

gguf = pytest.importorskip("gguf")
Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
f32 = np.float32


def weights_like(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights with a few outliers and an all-zero super-block, as trained matrices have."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[rng.random(x.shape) < 0.002] *= 8
    x[1, :256] = 0
    return x


# ---- the oracle: ggml-quants.c's quantize_row_q4_K_ref / quantize_row_q6_K_ref, one value at a time, in float32


def _nearest(value: np.float32) -> int:
    return int(np.rint(value))


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.float32, np.float32]:
    low, high, sum_w, sum_x = x[0], x[0], w[0], w[0] * x[0]
    for i in range(1, len(x)):
        low, high = min(low, x[i]), max(high, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    low = min(low, f32(0))
    if high == low:
        return f32(0), -low
    iscale = f32(nmax) / (high - low)
    scale = f32(1) / iscale
    best = f32(0)
    for i in range(len(x)):
        level = max(0, min(nmax, _nearest(iscale * (x[i] - low))))
        best += w[i] * (scale * level + low - x[i]) ** 2
    for step in range(21):
        iscale = (f32(-1) + f32(0.1) * step + nmax) / (high - low)
        levels = [max(0, min(nmax, _nearest(iscale * (x[i] - low)))) for i in range(len(x))]
        sum_l = sum_l2 = sum_xl = f32(0)
        for i, level in enumerate(levels):
            sum_l += w[i] * level
            sum_l2 += w[i] * level * level
            sum_xl += w[i] * level * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min, this_scale = f32(0), sum_xl / sum_l2
            error = f32(0)
            for i, level in enumerate(levels):
                error += w[i] * (this_scale * level + this_min - x[i]) ** 2
            if error < best:
                best, scale, low = error, this_scale, this_min
    return scale, -low


def reference_q4_k(block: np.ndarray) -> bytes:
    scales, mins = [], []
    for j in range(8):
        x = block[32 * j : 32 * j + 32]
        av_x = np.sqrt(sum((v * v for v in x), f32(0)) / f32(32))
        scale, low = _make_qkx2(x, av_x + np.abs(x), 15)
        scales.append(scale)
        mins.append(low)
    max_scale = max_min = f32(0)  # as C: a -0.0 minimum never replaces the 0 it starts from
    for scale, low in zip(scales, mins, strict=True):
        max_scale = scale if scale > max_scale else max_scale
        max_min = low if low > max_min else max_min
    inv_scale = f32(63) / max_scale if max_scale > 0 else f32(0)
    inv_min = f32(63) / max_min if max_min > 0 else f32(0)
    packed = [0] * 12
    ls = [min(63, _nearest(inv_scale * s)) for s in scales]
    lm = [min(63, _nearest(inv_min * m)) for m in mins]
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            packed[j - 4] |= (ls[j] >> 4) << 6
            packed[j] |= (lm[j] >> 4) << 6
    d, dmin = np.float16(max_scale / 63), np.float16(max_min / 63)
    levels = [0] * 256
    for j in range(8):
        step = f32(d) * ls[j]
        if step == 0:
            continue
        for i in range(32):
            levels[32 * j + i] = max(0, min(15, _nearest((block[32 * j + i] + f32(dmin) * lm[j]) / step)))
    nibbles = [levels[j + i] | (levels[j + i + 32] << 4) for j in range(0, 256, 64) for i in range(32)]
    return d.tobytes() + dmin.tobytes() + bytes(packed) + bytes(nibbles)


def _make_qx(x: np.ndarray, nmax: int) -> np.float32:
    peak = max(x, key=abs)  # the first value of largest magnitude
    if abs(peak) < 1e-15:
        return f32(0)

    def sums(iscale: np.float32) -> tuple[np.float32, np.float32]:
        sum_lx = sum_l2 = f32(0)
        for v in x:
            level = max(-nmax, min(nmax - 1, _nearest(iscale * v)))
            sum_lx += v * v * v * level
            sum_l2 += v * v * level * level
        return sum_lx, sum_l2

    sum_lx, sum_l2 = sums(f32(-nmax) / peak)
    scale = sum_lx / sum_l2 if sum_l2 else f32(0)
    best = scale * sum_lx
    for tweak in (*range(-9, 0), *range(1, 10)):
        sum_lx, sum_l2 = sums(-(nmax + f32(0.1) * tweak) / peak)
        if sum_l2 > 0 and sum_lx * sum_lx > best * sum_l2:
            scale = sum_lx / sum_l2
            best = scale * sum_lx
    return scale


def reference_q6_k(block: np.ndarray) -> bytes:
    scales = [_make_qx(block[16 * j : 16 * j + 16], 32) for j in range(16)]
    max_scale = max(scales, key=abs)
    if abs(max_scale) < 1e-15:
        return bytes(210)
    iscale = f32(-128) / max_scale
    d = np.float16(f32(1) / iscale)
    small = [min(127, _nearest(iscale * s)) for s in scales]
    levels = [32] * 256
    for j in range(16):
        step = f32(d) * small[j]
        if step == 0:
            continue
        for i in range(16):
            levels[16 * j + i] = max(-32, min(31, _nearest(block[16 * j + i] / step))) + 32
    ql, qh = [], []
    for j in (0, 128):
        low = [[levels[j + 32 * k + i] & 0xF for i in range(32)] for k in range(4)]
        ql += [low[0][i] | (low[2][i] << 4) for i in range(32)] + [low[1][i] | (low[3][i] << 4) for i in range(32)]
        qh += [sum((levels[j + 32 * k + i] >> 4) << (2 * k) for k in range(4)) for i in range(32)]
    return bytes(ql) + bytes(qh) + np.array(small, dtype=np.int8).tobytes() + d.tobytes()


# ---- the tests


@pytest.mark.parametrize(("qtype", "reference"), [(Q4_K, reference_q4_k), (Q6_K, reference_q6_k)])
def test_blocks_equal_ggmls_reference_quantizer_transcribed(qtype: object, reference: object) -> None:
    x = weights_like(2, 1024, seed=3)
    blocks = quantize_k(x, qtype).reshape(8, -1)
    dequantized = gguf.quants.dequantize(blocks, qtype)
    for index, block in enumerate(x.reshape(8, 256)):
        expected = np.frombuffer(reference(block), dtype=np.uint8)  # type: ignore[operator]
        if qtype is Q6_K and not block.any():
            assert not dequantized[index].any()  # a zero block: d = 0 (the level bytes are unread)
            continue
        assert blocks[index].tobytes() == expected.tobytes(), index


def group_levels(blocks: np.ndarray, qtype: object) -> np.ndarray:
    """Every group's representable values as the blocks store them: ``[groups, levels]``, read with gguf's
    own unpacking of the scales (Q4_K: ``d·sc·q - dmin·m``, q in 0..15; Q6_K: ``d·sc·q``, q in -32..31)."""
    blocks = blocks.reshape(-1, 144 if qtype is Q4_K else 210)
    if qtype is Q4_K:
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        step, offset = (d * sc).reshape(-1, 1), (dmin * m).reshape(-1, 1)
        return step * np.arange(16, dtype=np.float32) - offset
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return (d * sc).reshape(-1, 1) * np.arange(-32, 32, dtype=np.float32)


@pytest.mark.parametrize(("qtype", "rms"), [(Q4_K, 0.08), (Q6_K, 0.022)])
def test_ggufs_dequantizer_reads_each_value_back_as_its_nearest_level(qtype: object, rms: float) -> None:
    x = weights_like(64, 768)
    blocks = quantize_k(x, qtype)
    assert blocks.shape == tuple(gguf.quants.quant_shape_to_byte_shape(x.shape, qtype))
    back = gguf.quants.dequantize(blocks, qtype)
    assert back.shape == x.shape and np.array_equal(back[1, :256], np.zeros(256))  # zeros stay exact
    # The format's bound: a value comes back as the nearest value its group can hold (half a level step
    # inside the group's range, the distance to the range's end beyond it), never further.
    levels = group_levels(blocks, qtype)
    groups = x.reshape(len(levels), -1)
    nearest = np.abs(groups[:, :, None] - levels[:, None, :]).min(axis=2)
    error = np.abs(back - x).reshape(groups.shape)
    assert (error <= nearest + 1e-6 * np.abs(groups) + 1e-9).all()
    # Measured on these weights: 0.077 and 0.021 of their spread (gguf's own Q4_0: 0.104, Q5_0: 0.051).
    assert np.sqrt((error**2).mean()) < rms * x.std()


def test_q4_k_m_mix_is_llama_cpps() -> None:
    n = 32  # a 7B's layers: llama.cpp's use_more_bits gives half the attn_v and ffn_down tensors Q6_K
    width = (4096, 4096)
    six = [i for i in range(n) if q4_k_m_type(f"blk.{i}.attn_v.weight", width, n, has_output=True) == Q6_K]
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert all(q4_k_m_type(f"blk.{i}.ffn_down.weight", (4096, 11008), n, has_output=True) == Q6_K for i in six)
    assert q4_k_m_type("blk.5.ffn_down.weight", (4096, 11008), n, has_output=True) == Q4_K
    assert q4_k_m_type("blk.0.attn_q.weight", width, n, has_output=True) == Q4_K
    assert q4_k_m_type("output.weight", (32000, 4096), n, has_output=True) == Q6_K
    assert q4_k_m_type("token_embd.weight", (32000, 4096), n, has_output=True) == Q4_K
    assert q4_k_m_type("token_embd.weight", (32000, 4096), n, has_output=False) == Q6_K  # tied: it is the output
    # Rows not a multiple of 256 wide fall back as llama-quantize's do.
    assert q4_k_m_type("blk.4.attn_q.weight", (96, 96), n, has_output=True) == gguf.GGMLQuantizationType.Q5_0
    assert q4_k_m_type("output.weight", (320, 96), n, has_output=True) == gguf.GGMLQuantizationType.Q8_0
    assert q4_k_m_type("blk.4.attn_q.weight", (40, 40), n, has_output=True) == gguf.GGMLQuantizationType.F16
