"""A Ferry DiT LoRA checkpoint in diffusers: the family's pipeline loads it with ``load_lora_weights`` and its
transformer then gives, on the same inputs, exactly the outputs of Ferry's own model with the adapter on.

The adapter covers every Linear of the tiny DiT (attention, MLPs, modulation, embedders, the output head), so
a key diffusers renames, drops or cannot place shows up as a difference here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jobs.models.diffusion.components import load_transformer
from jobs.models.diffusion.model import apply_dit_lora, family_of_model, save_dit
from jobs.models.diffusion.variants import Conditioning
from jobs.models.family import linear_module_names

pytestmark = pytest.mark.filterwarnings("ignore")
PIPELINES = {"qwen": "QwenImagePipeline", "wan": "WanPipeline", "flux1": "FluxPipeline", "flux2": "Flux2Pipeline"}


def _inputs(dit: Any, family: str) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
    config = dit.config
    generator = torch.Generator().manual_seed(1)
    if family == "wan":  # video latents [B, C, F, H, W], umT5 embeddings
        latents = torch.randn(1, config.in_channels, 2, 4, 4, generator=generator)
        return latents, torch.tensor([0.6]), Conditioning(torch.randn(1, 5, config.text_dim, generator=generator))
    channels = config.in_channels if family == "flux2" else config.in_channels // 4  # 2x2 patches packed
    latents = torch.randn(1, channels, 1, 4, 4, generator=generator)
    embeds = torch.randn(1, 5, config.joint_attention_dim, generator=generator)
    pooled = torch.randn(1, config.pooled_projection_dim, generator=generator) if family == "flux1" else None
    guidance = torch.tensor([3.5]) if getattr(config, "guidance_embeds", False) else None
    mask = torch.ones(1, 5, dtype=torch.long) if family == "qwen" else None
    return latents, torch.tensor([0.6]), Conditioning(embeds, mask, pooled, guidance)


def _ferry_lora_checkpoint(path: Path, checkpoint: Path) -> Any:
    """Ferry's DiT with a LoRA on every Linear, its adapter weights random (as trained ones are: B != 0)."""
    dit = load_transformer(path, "pretrained", torch.float32, 0)
    targets = sorted({name for name in linear_module_names(dit)})
    dit = apply_dit_lora(dit, SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules=targets))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, parameter in dit.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.2)
    checkpoint.mkdir()
    save_dit(dit, checkpoint)
    return dit.eval()


@pytest.mark.parametrize("family", ["qwen", "wan", "flux1", "flux2"])
def test_a_ferry_lora_changes_the_pipelines_transformer_as_ferrys_model(
    family: str, pipelines: Path, flux_pipelines: Path, tmp_path: Path
) -> None:
    import diffusers

    path = (pipelines if family in ("qwen", "wan") else flux_pipelines) / family
    ferry = _ferry_lora_checkpoint(path, tmp_path / "step-00000001")
    latents, sigma, cond = _inputs(ferry, family)
    predict = family_of_model(ferry).predict

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(str(path))
    with torch.no_grad():
        before = predict(pipe.transformer, latents, sigma, cond)
        pipe.load_lora_weights(str(tmp_path / "step-00000001"))
        after = predict(pipe.transformer, latents, sigma, cond)
        expected = predict(ferry, latents, sigma, cond)
    wrapped = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {n for n, m in ferry.named_modules() if hasattr(m, "lora_A")}  # every adapter placed
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapter matters ...
    # ... and diffusers applies it as Ferry does: to float32 rounding, not bit for bit. The two models reach the same
    # sums by different module paths (diffusers' own peft integration), and on some CPUs oneDNN's kernels round them
    # differently (seen: 1.2e-6 at most, where the adapter itself moves the output by more than 1e-3).
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


# ---- the LoRA file for ComfyUI (python -m jobs export CHECKPOINT --format lora)


def comfyui_lora_key_map(model_keys: list[str], family: str, diffusers_to_comfy: dict[str, str]) -> dict[str, str]:
    """ComfyUI's ``model_lora_keys_unet`` (comfy/lora.py; its ``load_lora`` reads ``<stem>.lora_B.weight`` and
    ``<stem>.lora_A.weight``, and ``<stem>.alpha`` where present) for these families, re-implemented from its source as
    the oracle: LoRA key stem -> the model weight it patches. Every model gets the generic
    ``diffusion_model.<name>`` and ``lora_unet_<name_with_underscores>``; Qwen-Image also ``transformer.<name>``
    and the bare name; Flux maps diffusers' ``transformer.<name>`` through ``flux_to_diffusers`` (given here as
    diffusers' module name -> ComfyUI's weight)."""
    key_map: dict[str, str] = {}
    for key in model_keys:
        if key.startswith("diffusion_model.") and key.endswith(".weight"):
            stem = key[: -len(".weight")]
            key_map["lora_unet_" + stem[len("diffusion_model.") :].replace(".", "_")] = key
            key_map[stem] = key
            if family == "qwen_image":
                key_map[stem[len("diffusion_model.") :]] = key
                key_map["transformer." + stem[len("diffusion_model.") :]] = key
    if family == "flux1":
        for diffusers_name, comfy_key in diffusers_to_comfy.items():
            key_map["transformer." + diffusers_name] = comfy_key
    return key_map


def comfyui_flux_to_diffusers(depth: int, single: int, hidden: int) -> dict[str, tuple[str, int | None, bool]]:
    """ComfyUI's ``flux_to_diffusers`` (comfy/utils.py), re-implemented from its source for Flux.1's weights:
    diffusers' name -> (the BFL weight it lands in, its row offset in a fused weight, scale/shift swapped)."""
    key_map: dict[str, tuple[str, int | None, bool]] = {}
    for i in range(depth):
        source, target = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for end in ("weight", "bias"):
            for n, (img, txt) in enumerate((("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj"))):
                key_map[f"{source}.attn.{img}.{end}"] = (f"{target}.img_attn.qkv.{end}", n * hidden, False)
                key_map[f"{source}.attn.{txt}.{end}"] = (f"{target}.txt_attn.qkv.{end}", n * hidden, False)
            for a, b in (("attn.to_out.0", "img_attn.proj"), ("norm1.linear", "img_mod.lin"),
                         ("norm1_context.linear", "txt_mod.lin"), ("attn.to_add_out", "txt_attn.proj"),
                         ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                         ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2")):  # fmt: skip
                key_map[f"{source}.{a}.{end}"] = (f"{target}.{b}.{end}", None, False)
        for a, b in (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                     ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")):  # fmt: skip
            key_map[f"{source}.attn.{a}.weight"] = (f"{target}.{b}.weight", None, False)
    for i in range(single):
        source, target = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for end in ("weight", "bias"):
            for n, name in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
                key_map[f"{source}.{name}.{end}"] = (f"{target}.linear1.{end}", n * hidden, False)
            key_map[f"{source}.norm.linear.{end}"] = (f"{target}.modulation.lin.{end}", None, False)
            key_map[f"{source}.proj_out.{end}"] = (f"{target}.linear2.{end}", None, False)
        key_map[f"{source}.attn.norm_q.weight"] = (f"{target}.norm.query_norm.weight", None, False)
        key_map[f"{source}.attn.norm_k.weight"] = (f"{target}.norm.key_norm.weight", None, False)
    for bfl, diffusers_name in (("final_layer.linear", "proj_out"), ("img_in", "x_embedder"),
                                ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
                                ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
                                ("txt_in", "context_embedder"),
                                ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
                                ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
                                ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
                                ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")):  # fmt: skip
        for end in ("weight", "bias"):
            key_map[f"{diffusers_name}.{end}"] = (f"{bfl}.{end}", None, False)
    for end in ("weight", "bias"):
        key_map[f"norm_out.linear.{end}"] = (f"final_layer.adaLN_modulation.1.{end}", None, True)
    return key_map


def _swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    scale, shift = weight.chunk(2, dim=0)
    return torch.cat([shift, scale], dim=0)


def _flux_converter(width: int) -> Any:
    """diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` for a Flux ``width`` wide: the function
    fixes Flux.1-dev's 3072 in its body, so its own source is compiled again with the tiny model's width."""
    import inspect
    import textwrap

    from diffusers.loaders import single_file_utils

    source = textwrap.dedent(inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers))
    assert "inner_dim = 3072" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), namespace)  # diffusers' own code
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"]


def _comfyui_model_keys(family: str, dit: Any) -> tuple[list[str], dict[str, str]]:
    """ComfyUI's model weight names for this DiT (``diffusion_model.`` + its own names), and for Flux.1 the
    map its ``flux_to_diffusers`` gives. Qwen-Image's names are diffusers' own; Wan's and Flux.1's (the original
    checkpoints' names, which ComfyUI's models load as they are) are checked against diffusers' single-file
    converters, original -> diffusers: every weight must come back under its diffusers name."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from jobs.models.diffusion.lora_file import wan_module_name

    if family == "wan":
        linears = sorted(linear_module_names(dit))
        for name in linears:
            converted = convert_wan_transformer_to_diffusers({f"{wan_module_name(name)}.weight": torch.zeros(1)})
            assert list(converted) == [f"{name}.weight"], name
        return [f"diffusion_model.{wan_module_name(name)}.weight" for name in linears], {}
    if family != "flux1":
        return [f"diffusion_model.{key}" for key in dit.state_dict()], {}
    config = dit.config
    mapping = comfyui_flux_to_diffusers(
        config.num_layers, config.num_single_layers, config.num_attention_heads * config.attention_head_dim
    )
    state = dit.state_dict()
    assert set(state) <= set(mapping), sorted(set(state) - set(mapping))[:5]
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        target, offset, swapped = mapping[name]
        # Flux's RMSNorms hold ``scale`` in the original checkpoints (ComfyUI's map names them ``.weight``,
        # which no LoRA of a Linear meets).
        target = target.replace("_norm.weight", "_norm.scale")
        pieces.setdefault(target, []).append((offset or 0, _swap_scale_shift(tensor) if swapped else tensor))
    original = {
        target: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for target, parts in pieces.items()
    }
    back = _flux_converter(config.num_attention_heads * config.attention_head_dim)(dict(original))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    names = {n[: -len(".weight")]: f"diffusion_model.{mapping[n][0]}" for n in state if n.endswith(".weight")}
    return [f"diffusion_model.{key}" for key in original], names


@pytest.mark.parametrize("family", ["qwen", "wan", "flux1"])
def test_the_lora_file_loads_in_diffusers_and_every_key_maps_in_comfyui(
    family: str, pipelines: Path, flux_pipelines: Path, tmp_path: Path
) -> None:
    import json

    import diffusers
    from safetensors import safe_open

    from jobs.cli import main

    path = (pipelines if family in ("qwen", "wan") else flux_pipelines) / family
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000001"
    checkpoint.parent.mkdir(parents=True)
    ferry = _ferry_lora_checkpoint(path, checkpoint)
    spec = {
        "name": "dog",
        "model": {"kind": "diffusers_transformer", "path": str(path)},
        "data": {"trigger_word": "sks dog"},
        "training": {"learning_rate": 1e-4, "steps": 1},
    }
    (checkpoint / "manifest.json").write_text(json.dumps({"spec": spec, "step": 1, "created": "2026-12-07"}))
    assert main(["export", str(checkpoint), "--format", "lora"]) == 0
    written = tmp_path / "out" / "exports" / "step-00000001-lora.safetensors"

    with safe_open(str(written), framework="pt") as handle:
        meta, keys = handle.metadata(), list(handle.keys())
    assert meta["modelspec.trigger_phrase"] == "sks dog" and meta["ss_training_comment"] == "trigger word: sks dog"
    assert meta["ss_network_dim"] == meta["ss_network_alpha"] == "4"  # Ferry's scale (alpha 8 / rank 4) is in lora_B
    assert meta["ss_base_model_version"] == {"qwen": "qwen_image"}.get(family, family)

    # ComfyUI: every key's module is a weight of ComfyUI's model, and every module has up, down and alpha.
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(str(path))
    name = {"qwen": "qwen_image"}.get(family, family)
    model_keys, flux_names = _comfyui_model_keys(name, pipe.transformer)
    key_map = comfyui_lora_key_map(model_keys, name, flux_names)
    stems = {k.rsplit(".lora_", 1)[0] for k in keys}
    assert stems and all(stem in key_map for stem in stems), sorted(stems - set(key_map))[:5]
    assert {key_map[stem] for stem in stems} <= set(model_keys)
    assert keys == sorted(f"{s}.{part}" for s in stems for part in ("lora_A.weight", "lora_B.weight"))
    assert len(stems) == len(linear_module_names(pipe.transformer))  # every Linear of the DiT has its adapter

    # diffusers: the same file changes the pipeline's transformer exactly as Ferry's adapter does.
    latents, sigma, cond = _inputs(ferry, family)
    predict = family_of_model(ferry).predict
    with torch.no_grad():
        pipe.load_lora_weights(str(written))
        torch.testing.assert_close(
            predict(pipe.transformer, latents, sigma, cond), predict(ferry, latents, sigma, cond), rtol=0, atol=1e-5
        )


def test_the_lora_file_refuses_what_is_not_a_diffusion_lora_checkpoint(tmp_path: Path) -> None:
    import json

    from jobs.models.diffusion.lora_file import write_lora_file

    with pytest.raises(ValueError, match="still being written"):
        write_lora_file(tmp_path / ".tmp-step-00000001-abcd")
    with pytest.raises(ValueError, match="not a Ferry checkpoint"):
        write_lora_file(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": {"model": {"kind": "hf_causal_lm"}}}))
    with pytest.raises(ValueError, match="not a LoRA checkpoint of a diffusers_transformer model"):
        write_lora_file(tmp_path)
    assert not (tmp_path.parent / "exports").exists()
