"""A Hugging Face causal LM directory as one GGUF file: what llama.cpp, Ollama and LM Studio load.

:func:`write_gguf` reads a ``save_pretrained`` directory (``config.json``, safetensors weights, a fast
tokenizer's ``tokenizer.json``) and writes the GGUF llama.cpp's own ``convert_hf_to_gguf.py`` would for the
Llama family: the same metadata keys (``{arch}.context_length``, ``tokenizer.ggml.*``, the chat template),
the same tensor names (``gguf.get_tensor_name_map``), Llama's q/k rows reordered for llama.cpp's rotary
layout, 1-D tensors (norms, biases) kept in f32. The ``gguf`` package (llama.cpp's own Python library) does
the writing and the ``q8_0`` quantization; ``q4_k_m`` is llama.cpp's mix of Q4_K and Q6_K tensors, quantized
by `jobs.checkpoints.k_quants`. Other K-quants are llama.cpp's C++ quantizer's work: the error says which
``llama-quantize`` command makes one from the f16 file.

The file is written beside its final name and renamed into place: a reader sees no file or a whole one.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobs.checkpoints.gguf_quants import check_quant

log = logging.getLogger(__name__)

# Hugging Face model_type -> the GGUF architecture llama.cpp runs it as, and whether q/k get permuted.
# Mistral is llama to llama.cpp (convert_hf_to_gguf.py registers MistralForCausalLM on its llama class).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "mistral": ("LLAMA", True),
    "qwen2": ("QWEN2", False),
    "qwen3": ("QWEN3", False),
}

# The split regexes of the byte-level BPE pre-tokenizers llama.cpp implements, by its tokenizer.ggml.pre
# name (llama-vocab.cpp). A tokenizer.json whose pre_tokenizer splits with one of these is that tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PRE_TOKENIZERS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2", _TEKKEN_SPLIT: "tekken"}

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class GgufExport:
    """What :func:`write_gguf` wrote: the file, its architecture and type, its size."""

    path: Path
    architecture: str
    quant: str
    tensor_count: int
    size_bytes: int


def write_gguf(model_dir: Path, output: Path, quant: str = "f16") -> GgufExport:
    """Write the Hugging Face causal LM in ``model_dir`` as one GGUF file at ``output``.

    Args:
        model_dir: A ``save_pretrained`` directory: ``config.json``, ``model.safetensors`` (or shards with
            ``model.safetensors.index.json``), and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``).
        output: The ``.gguf`` file to write (replaced if it exists).
        quant: ``f32``, ``f16``, ``bf16``, ``q8_0`` or ``q4_k_m``.

    Returns:
        What was written.

    Raises:
        ValueError: an architecture other than llama, mistral, qwen2, qwen3; a quantized (bitsandbytes, GPTQ)
            checkpoint; no safetensors or no ``tokenizer.json``; a pre-tokenizer llama.cpp has no name for;
            an unknown quant.

    Example:
        >>> write_gguf(Path("out/chat/exports/step-00000100-merged"), Path("chat-q8_0.gguf"), "q8_0")
        GgufExport(path=PosixPath('chat-q8_0.gguf'), architecture='llama', quant='q8_0', ...)
    """
    import gguf

    quant = check_quant(quant)
    model_dir, output = Path(model_dir), Path(output)
    config = _read_config(model_dir)
    arch_name, permute_qk = ARCHITECTURES[config["model_type"]]
    arch = gguf.MODEL_ARCH[arch_name]
    weight_files = _weight_files(model_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".tmp-{output.name}-{uuid.uuid4().hex[:8]}")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    try:
        _add_hyperparameters(writer, config, quant, name=model_dir.name)
        _add_tokenizer(writer, model_dir, config)
        tensors = list(_tensor_plan(config, arch, weight_files, quant, permute_qk))
        for planned in tensors:
            writer.add_tensor_info(
                planned.name, planned.shape, np.dtype(np.float32), planned.nbytes, raw_dtype=planned.qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for planned in tensors:  # one tensor in memory at a time: a 7B model needs no 14 GB of host memory
            writer.write_tensor_data(planned.encode())
        writer.close()
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    size = output.stat().st_size
    log.info("wrote %s (%s, %s, %d tensors, %.1f MB)", output, arch_name.lower(), quant, len(tensors), size / 1e6)
    return GgufExport(output, gguf.MODEL_ARCH_NAMES[arch], quant, len(tensors), size)


def export_gguf(
    checkpoint: Path, output: Path | None = None, quant: str = "f16", *, modelfile: bool = True
) -> GgufExport:
    """A checkpoint as a GGUF file (and an Ollama Modelfile beside it), merging a LoRA adapter first.

    Args:
        checkpoint: A Ferry checkpoint directory (a LoRA job's is merged into its base, a full fine-tune's is
            a whole model already), or any Hugging Face model directory.
        output: The ``.gguf`` to write; default ``<output_dir>/exports/<checkpoint>-<quant>.gguf`` for a Ferry
            checkpoint, ``<directory>-<quant>.gguf`` beside any other directory.
        quant: ``f32``, ``f16``, ``bf16``, ``q8_0`` or ``q4_k_m``.
        modelfile: Also write ``<output stem>.Modelfile`` (`jobs.checkpoints.ollama_modelfile`).

    Raises:
        ValueError: an unknown quant, a checkpoint still being written or not a model, a LoRA checkpoint whose
            base is gone, or anything :func:`write_gguf` refuses. Nothing is left behind.

    Example:
        >>> export_gguf(Path("out/chat/checkpoints/step-00000100"), quant="q8_0").path
        PosixPath('out/chat/exports/step-00000100-q8_0.gguf')
    """
    from jobs.checkpoints.directory import EXPORTS_DIR

    quant = check_quant(quant)
    checkpoint = Path(checkpoint)
    if checkpoint.name.startswith(".tmp-"):
        raise ValueError(f"{checkpoint} is a checkpoint still being written; export it once it is saved")
    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint {checkpoint} is not a directory")
    ferry = (checkpoint / "manifest.json").is_file()
    if ferry:
        from jobs.checkpoints.export import check_finite_weights

        check_finite_weights(checkpoint)  # before any file is made: a diverged run is refused whole
    if output is None:
        stem = f"{checkpoint.name}-{quant}.gguf"
        output = checkpoint.parent.parent / EXPORTS_DIR / stem if ferry else checkpoint.parent / stem
    output = Path(output)
    if (checkpoint / "adapter_config.json").is_file():
        from jobs.checkpoints.export import merge_lora_checkpoint

        output.parent.mkdir(parents=True, exist_ok=True)
        merged = output.with_name(f".tmp-merge-{output.stem}-{uuid.uuid4().hex[:8]}")
        try:
            merge_lora_checkpoint(checkpoint, merged, archive=False)
            return _write_with_modelfile(merged, output, quant, modelfile)
        finally:
            shutil.rmtree(merged, ignore_errors=True)
    return _write_with_modelfile(checkpoint, output, quant, modelfile)


def _write_with_modelfile(model_dir: Path, output: Path, quant: str, modelfile: bool) -> GgufExport:
    written = write_gguf(model_dir, output, quant)
    if modelfile:
        from jobs.checkpoints.ollama_modelfile import write_modelfile

        try:
            write_modelfile(model_dir, output)
        except BaseException:
            output.unlink(missing_ok=True)  # the pair or nothing
            raise
    return written


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(
            f"{model_dir} has no readable config.json: a GGUF is written from a whole Hugging Face model "
            "(a full fine-tune's checkpoint, or a LoRA checkpoint merged into its base)"
        ) from None
    config = {**config, **config.get("text_config", {})}
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} of {model_dir} is not one this GGUF export writes "
            f"(choose a model of {', '.join(ARCHITECTURES)}; for others run llama.cpp's convert_hf_to_gguf.py)"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"{model_dir} holds {method}-quantized weights; GGUF is written from float weights: merge or save "
            "the model in bf16 or float32 first (model.dtype), then export"
        )
    return config


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{model_dir} has no model.safetensors (nor an index of shards); a LoRA checkpoint holds only its "
        "adapter: export it through its checkpoint (merged into the base first), not its directory alone"
    )


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's rope_parameters, else the older rope_scaling plus rope_theta."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _add_hyperparameters(writer: Any, config: dict[str, Any], quant: str, *, name: str) -> None:
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    rope_type = rope["rope_type"]
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type not in ("default", "llama3"):  # llama3: the rope_freqs tensor (_llama3_rope_factors)
        raise ValueError(
            f"config.json rope scaling {rope_type!r} has no GGUF form here (default, linear, yarn, llama3 do)"
        )
    if config.get("head_dim") is not None:  # as the converter: only a head size the config states
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if ARCHITECTURES[config["model_type"]][0] == "LLAMA":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(config))
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    }
    writer.add_file_type(file_types[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE ``tokenizer.json``, from how it splits text.

    llama.cpp re-implements each pre-tokenizer by name; a wrong name tokenizes digits, spaces or
    contractions differently from the model's training. Raises ValueError for one it has no name for.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # SmolLM's: every digit alone, then GPT-2's split
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        name = SPLIT_PRE_TOKENIZERS.get(steps[0].get("pattern", {}).get("Regex"))
        if name is not None:
            return name
    raise ValueError(
        f"tokenizer.json's pre_tokenizer ({json.dumps(pre)[:200]}) is not one this export names for llama.cpp "
        f"(gpt-2, smollm, {', '.join(SPLIT_PRE_TOKENIZERS.values())}); convert with llama.cpp's "
        "convert_hf_to_gguf.py, which knows more"
    )


def _is_sentencepiece_bpe(tokenizer_json: dict[str, Any]) -> bool:
    """Llama 2 / Mistral's tokenizer: BPE over "▁"-joined text with byte fallback (llama.cpp's "llama" model)."""
    model = tokenizer_json.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _add_tokenizer(writer: Any, model_dir: Path, config: dict[str, Any]) -> None:
    import gguf
    from transformers import AutoTokenizer

    try:
        tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        raise ValueError(
            f"{model_dir} has no readable tokenizer.json; llama.cpp needs the vocabulary in the file: save the "
            "job's tokenizer (a fast Hugging Face tokenizer) with the model"
        ) from None
    vocab_size = config["vocab_size"]
    if _is_sentencepiece_bpe(tokenizer_json):
        vocab = gguf.LlamaHfVocab(model_dir)
        # llama.cpp's "llama" tokenizer merges the adjacent pair whose joined token scores highest; a token's
        # score is minus the rank of the merge that makes it, so it merges in the BPE's order (LlamaHfVocab
        # gives every token -1000, which would merge left to right instead).
        ranks = _merge_ranks(tokenizer_json)
        tokens: list[bytes] = []
        scores: list[float] = []
        types: list[int] = []
        for text, score, token_type in vocab.all_tokens():
            tokens.append(text)
            rank = ranks.get(text.decode("utf-8", errors="replace"))
            scores.append(-float(rank) if rank is not None and int(token_type) == NORMAL else score)
            types.append(int(token_type))
        tokens += [f"[PAD{i}]".encode() for i in range(len(tokens), vocab_size)]
        scores += [-1000.0] * (vocab_size - len(scores))
        types += [UNUSED] * (vocab_size - len(types))
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(model_dir, n_vocab=len(tokens))
    else:
        pre = pre_tokenizer_name(tokenizer_json)
        tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
        byte_tokens, types = _byte_level_vocab(tokenizer, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(byte_tokens)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    if "bos" not in special.add_special_token:
        # What the tokenizer does, not a default: readers of the file (llama.cpp, transformers) otherwise
        # guess from the tokenizer model, and a "llama" one gets a BOS this tokenizer never adds.
        hf: Any = AutoTokenizer.from_pretrained(str(model_dir))
        probe, bos = hf("a").input_ids, hf.bos_token_id
        special.add_special_token["bos"] = bos is not None and bool(probe) and probe[0] == bos
    special.add_to_gguf(writer, quiet=True)


def _merge_ranks(tokenizer_json: dict[str, Any]) -> dict[str, int]:
    """Each merged token's text and the rank of the merge that makes it (the first merge that does)."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(tokenizer_json.get("model", {}).get("merges", [])):
        joined = "".join(merge.split(" ", 1) if isinstance(merge, str) else merge)
        ranks.setdefault(joined, rank)
    return ranks


def _byte_level_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token (``[PADn]`` for ids the tokenizer lacks) and its GGUF type, as llama.cpp lists them.

    Added tokens are CONTROL when special (``<|im_end|>``), else USER_DEFINED; llama.cpp matches both whole
    in the text before splitting it.
    """
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(
            f"the tokenizer has token id {max(by_id)} but config.json vocab_size is {vocab_size}: "
            "resize the embeddings to the tokenizer before export"
        )
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(UNUSED)
        elif index in added:
            tokens.append(token)
            special = added[index].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(CONTROL if special else USER_DEFINED)
        else:
            tokens.append(token)
            types.append(NORMAL)
    return tokens, types


@dataclass
class _PlannedTensor:
    """One tensor of the file: its GGUF name, numpy shape, type and size, and how to read and encode it."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    nbytes: int
    read: Any  # () -> torch.Tensor (float32, already permuted)

    def encode(self) -> np.ndarray:
        import gguf

        data = self.read().numpy()
        if self.qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            from jobs.checkpoints.k_quants import quantize_k  # the gguf package reads these but does not write them

            return quantize_k(data, self.qtype)
        return gguf.quants.quantize(data, self.qtype)


def _tensor_plan(
    config: dict[str, Any], arch: Any, weight_files: list[Path], quant: str, permute_qk: bool
) -> Iterator[_PlannedTensor]:
    import gguf
    from safetensors import safe_open

    from jobs.checkpoints.k_quants import q4_k_m_type

    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    tied = bool(config.get("tie_word_embeddings", False))
    wanted = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_k_m": gguf.GGMLQuantizationType.Q4_K,  # per tensor: k_quants.q4_k_m_type
    }[quant]
    for path in weight_files:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
        for hf_name in names:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from rope_theta
            if tied and hf_name == "lm_head.weight":
                continue  # llama.cpp reuses token_embd when output.weight is absent
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"tensor {hf_name!r} of {path.name} has no GGUF name for {config['model_type']}")
            with safe_open(str(path), framework="pt") as handle:
                shape = tuple(handle.get_slice(hf_name).get_shape())
            heads_of = heads if ".q_proj." in hf_name else kv_heads if ".k_proj." in hf_name else 0
            qtype = wanted
            if len(shape) <= 1 or name.endswith("_norm.weight"):
                qtype = gguf.GGMLQuantizationType.F32  # as llama.cpp keeps them: tiny, and precision-bound
            elif quant == "q4_k_m":
                qtype = q4_k_m_type(name, shape, config["num_hidden_layers"], has_output=not tied)
            elif qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % 32:
                qtype = gguf.GGMLQuantizationType.F16  # q8_0 blocks are 32 wide; the converter falls back too
            yield _PlannedTensor(
                name, shape, qtype, _nbytes(shape, qtype), _reader(path, hf_name, heads_of if permute_qk else 0)
            )
    rope = _rope(config)
    if rope["rope_type"] == "llama3":
        factors = _llama3_rope_factors(rope, _head_dim(config))
        yield _PlannedTensor(
            gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
            tuple(factors.shape),
            gguf.GGMLQuantizationType.F32,
            factors.numel() * 4,
            lambda: factors,
        )


def _nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    import gguf

    return math.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)) if shape else 4


def _reader(path: Path, hf_name: str, permute_heads: int) -> Any:
    def read() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(hf_name).to(torch.float32)
        return permute_for_llama_cpp(tensor, permute_heads) if permute_heads else tensor

    return read


def permute_for_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder a Llama q/k projection's rows from Hugging Face's rotary layout to llama.cpp's.

    Hugging Face rotates each head's first half against its second half (``rotate_half``); llama.cpp's
    llama rotates adjacent pairs. Within every head, row ``i`` of the first half and row ``i`` of the second
    become rows ``2i`` and ``2i + 1`` (transformers' GGUF loader undoes exactly this).
    """
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Llama 3.1's per-frequency rope divisors, the ``rope_freqs`` tensor llama.cpp reads them from."""
    base = float(rope["rope_theta"])
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelength = 2 * math.pi / freqs
    smooth = (original / wavelength - low) / (high - low)
    mixed = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelength < original / high, torch.ones_like(freqs), mixed)
    return torch.where(wavelength > original / low, torch.full_like(freqs, factor), factors)
