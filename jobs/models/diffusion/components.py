"""Loading a pipeline directory's parts with diffusers' and transformers' own classes, or random weights.

``model.init: random`` builds each part from its ``config.json`` with its weights on the meta device
(accelerate's ``init_empty_weights``; buffers such as RoPE tables are computed as usual), allocates the
weights once on the CPU in the target dtype and fills them in parallel (norms 1, biases 0, matrices N(0, 0.02)): a 20B DiT
is ready in seconds and no weight file is read, which is what benchmarks of the real shapes need.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn

from jobs.models.diffusion.variants import DiffusionFamily, family_of


def _diffusers_class(name: str) -> Any:
    import diffusers

    return getattr(diffusers, name)


def load_transformer(path: Path, init: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """The DiT of the pipeline at ``path`` on the CPU."""
    family = family_of(path)
    cls = _diffusers_class(family.transformer_class)
    if init == "pretrained":
        model = cls.from_pretrained(str(path / "transformer"), torch_dtype=dtype, local_files_only=True)
        return own_storage(model)
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(cls.load_config(str(path / "transformer")))
    return random_init(materialize(model, dtype), seed)


def load_vae(path: Path, family: DiffusionFamily, init: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """The VAE (``vae/``) on the CPU, in eval mode and frozen."""
    cls = _diffusers_class(family.vae_class)
    folder = _part(path, "vae")
    if init == "pretrained":
        vae = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    else:
        vae = random_init(cls.from_config(cls.load_config(str(folder))).to(dtype), seed + 1)
    return vae.eval().requires_grad_(False)


def load_text_encoder(
    path: Path,
    family: DiffusionFamily,
    init: str,
    dtype: torch.dtype,
    seed: int,
    *,
    folder: str | None = None,
    class_name: str | None = None,
) -> nn.Module:
    """A text encoder (the family's, or ``folder`` of class ``class_name``) on the CPU, in eval mode and frozen;
    never runs remote code."""
    import transformers

    cls = getattr(transformers, class_name or family.text_encoder_class)
    folder_path = _part(path, folder or family.text_encoder_folder)
    if init == "pretrained":
        encoder = cls.from_pretrained(str(folder_path), dtype=dtype, local_files_only=True, trust_remote_code=False)
    else:
        config = transformers.AutoConfig.from_pretrained(
            str(folder_path), local_files_only=True, trust_remote_code=False
        )
        with init_empty_weights(include_buffers=False):
            encoder = cls._from_config(config)
        encoder = random_init(materialize(encoder, dtype), seed + 2)
    return encoder.eval().requires_grad_(False)


def load_tokenizer(path: Path, folder: str = "tokenizer", *, processor: bool = False) -> Any:
    """The tokenizer in ``folder``; ``processor``: through AutoProcessor (Flux.2's PixtralProcessor folder), whose
    ``apply_chat_template`` the pipeline calls."""
    from transformers import AutoProcessor, AutoTokenizer

    loader = AutoProcessor if processor else AutoTokenizer
    return loader.from_pretrained(str(_part(path, folder)), local_files_only=True, trust_remote_code=False)


def _part(path: Path, name: str) -> Path:
    folder = Path(path) / name
    if not folder.is_dir():
        raise ValueError(
            f"model.path {path} has no {name}/ folder: encoding prompts and images (task: cache, on-the-fly "
            f"data, samples) needs the pipeline's {name}; train from a data.kind: diffusion_cache instead"
        )
    return folder


RANDOM_POOL = 1 << 24  # values drawn once per model; every matrix is a window of them


def random_init(model: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter of ``model`` reproducibly: norms' weights 1, other vectors 0, matrices N(0, 0.02).

    The matrices are windows (at an offset per tensor, wrapping around) of one pool of 16M values drawn
    from N(0, 0.02) with ``seed``: drawing 20B values one by one takes minutes on a CPU, copying them
    seconds, and a benchmark of the released shapes needs their sizes, not independent values. Tensors are
    filled in parallel (torch releases the GIL).
    """
    pool = torch.empty(RANDOM_POOL).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    pools: dict[torch.dtype, torch.Tensor] = {}
    norm_params = {
        id(p) for m in model.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(recurse=False)
    }
    for param in model.parameters():
        pools.setdefault(param.dtype, pool.to(param.dtype))

    def fill(index: int, param: torch.Tensor) -> None:
        with torch.no_grad():
            if param.dim() < 2:
                param.fill_(1.0 if id(param) in norm_params else 0.0)
                return
            source, flat = pools[param.dtype], param.view(-1)
            position, offset = 0, (index * 104_729) % RANDOM_POOL
            while position < flat.numel():
                take = min(flat.numel() - position, RANDOM_POOL - offset)
                flat[position : position + take].copy_(source[offset : offset + take])
                position, offset = position + take, 0

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool_threads:
        list(pool_threads.map(lambda item: fill(*item), enumerate(model.parameters())))
    return model


def materialize(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Give every meta-device parameter CPU storage of ``dtype`` (uninitialized), and cast the rest."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=dtype), requires_grad=param.requires_grad
                )
    return model.to(dtype)


def own_storage(model: nn.Module) -> nn.Module:
    """Give each parameter its own freshly allocated storage.

    Loaded weights can be views into one buffer at unaligned offsets, and CPU matmul kernels round
    differently for unaligned operands: the same weight then gives other last bits than its aligned copy
    in the offload engine. Owning aligned storage makes training with and without offload agree bitwise.
    """
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model
