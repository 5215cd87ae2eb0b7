"""Diffusion transformers on one GPU: a DiT of Qwen-Image's, Flux.1-dev's or Flux.2-dev's shape LoRA-trained from a
cache, and the cache's text encoder throughput, under ``offload.gpu_memory_limit``.

Every figure comes from a real job (``jobs.run_job``, what the service's worker runs), with random weights
(``model.init: random``) of the released shapes, on a synthetic cache of 1024 x 1024 latents (4096 image tokens).
``--family qwen_image`` (the default): Qwen-Image's 60-layer MMDiT (about 20B parameters), 64-token prompts, a
text encoder of Qwen2.5-VL 7B's shape, under 24 GiB. ``--family flux1``: Flux.1-dev's DiT (19 double + 38 single
blocks, 12B), T5's 512 tokens and CLIP-L's pooled embedding, the LoRA of
configs/diffusers_transformer_flux1_lora_model-offload.yaml, under 16 GiB. ``--family flux2``: Flux.2-dev's DiT
(8 double + 48 single blocks, 32B), 512 tokens of Mistral-Small-3.1's stacked hidden states, the LoRA of
configs/diffusers_transformer_flux2_lora_model-offload.yaml, a text encoder of Mistral-Small-3.1 24B's shape, under
24 GiB. Beside each step time: the copy floor (the streamed bytes twice, at the pinned host-to-device rate
measured in the same run) and the resident step (no offload, no limit).
``--only resident,resident-link-busy,ferry`` adds the resident job run while host-to-device copies keep the
link busy in the background (bench/copy_load.py): what copies cost a step the host bounds, apart from the
engine's own work.

Run on a GPU box:  python bench/diffusion_bench.py [--family qwen_image|flux1|flux2] [--steps 4] [--limit 24GiB] [--budget 14GiB] [--service [--service-rows resident,ferry]]
Check on a CPU:    python bench/diffusion_bench.py [--family flux1] --cpu --no-write
Writes its family's section of bench/RESULTS.md (date, GPU, torch, commit, figures) unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.copy_load import BackgroundCopies
from bench.link_rate import pinned_h2d_gbps
from bench.provenance import commit
from jobs import PathRoots, load_job_spec, run_job
from jobs.events import event_to_wire
from jobs.models.diffusion.data.cache import CacheWriter, model_fingerprint

RESULTS = Path(__file__).with_name("RESULTS.md")
ROOT = Path(__file__).resolve().parents[1]
ONLY_DEFAULT = "encoder,resident,ferry,seed"
SECTION = "## Diffusion transformers"
SEED_TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"
QWEN_IMAGE_DIT = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
TINY_DIT = {**QWEN_IMAGE_DIT, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
            "joint_attention_dim": 32, "axes_dims_rope": (8, 4, 4)}  # fmt: skip
QWEN25_VL_7B_TEXT = {
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "rope_type": "default"},
}  # fmt: skip
TINY_TEXT = {**QWEN25_VL_7B_TEXT, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], "rope_type": "default"}}  # fmt: skip
# Flux.1-dev's DiT is FluxTransformer2DModel's defaults (19 double + 38 single blocks) with the guidance embedding
# of the guidance-distilled dev weights; its VAE is AutoencoderKL with 16 latent channels and no quant convs.
FLUX1_DEV_DIT = {"guidance_embeds": True}
TINY_FLUX1_DIT = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
                  "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 16,
                  "guidance_embeds": True, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
FLUX1_VAE = {"block_out_channels": (128, 256, 512, 512), "latent_channels": 16, "shift_factor": 0.1159,
             "scaling_factor": 0.3611, "use_quant_conv": False, "use_post_quant_conv": False}  # fmt: skip
TINY_VAE = {"block_out_channels": (8, 8, 8, 8), "latent_channels": 4, "norm_num_groups": 4, "layers_per_block": 1}
CLIP_L_TEXT = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "projection_dim": 768}  # fmt: skip
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_layers": 24, "num_heads": 64, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "is_gated_act": True, "dense_act_fn": "gelu_new"}  # fmt: skip
TINY_CLIP = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "projection_dim": 16}  # fmt: skip
TINY_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 32, "num_layers": 2, "num_heads": 4}
# Flux.2-dev's DiT, VAE and text encoder are Flux2Transformer2DModel's, AutoencoderKLFlux2's and Mistral3Config's
# defaults (8 double + 48 single blocks; Mistral-Small-3.1 24B, whose hidden states 10, 20, 30 the DiT reads).
TINY_FLUX2_DIT = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
                  "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 32,
                  "axes_dims_rope": (4, 4, 4, 4)}  # fmt: skip
TINY_MISTRAL3 = {
    "text_config": {"model_type": "mistral", "vocab_size": 272, "hidden_size": 16, "intermediate_size": 16,
                    "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                    "max_position_embeddings": 1024},
    "vision_config": {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 8},
    "image_token_index": 271,
}  # fmt: skip


def _qwen_image_parts(root: Path, tiny: bool) -> None:
    """transformer/, text_encoder/ and vae/ configs of Qwen-Image's shapes."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig

    QwenImageTransformer2DModel(**(TINY_DIT if tiny else QWEN_IMAGE_DIT)).save_config(str(root / "transformer"))
    vae = (
        AutoencoderKLQwenImage(base_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)
        if tiny
        else AutoencoderKLQwenImage()
    )
    vae.save_config(str(root / "vae"))
    vision = (
        {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32} if tiny else {}
    )
    text = TINY_TEXT if tiny else QWEN25_VL_7B_TEXT
    Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, **{k: text[k] for k in ("hidden_size", "vocab_size")}
    ).save_pretrained(str(root / "text_encoder"))


def _flux1_parts(root: Path, tiny: bool) -> None:
    """transformer/, vae/, text_encoder/ (CLIP-L) and text_encoder_2/ (T5-XXL) configs of FLUX.1-dev's shapes."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, T5Config

    FluxTransformer2DModel(**(TINY_FLUX1_DIT if tiny else FLUX1_DEV_DIT)).save_config(str(root / "transformer"))
    blocks = {"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4}
    AutoencoderKL(**blocks, **(TINY_VAE if tiny else FLUX1_VAE)).save_config(str(root / "vae"))
    CLIPTextConfig(**(TINY_CLIP if tiny else CLIP_L_TEXT)).save_pretrained(str(root / "text_encoder"))
    T5Config(**(TINY_T5 if tiny else T5_XXL)).save_pretrained(str(root / "text_encoder_2"))


def _flux2_parts(root: Path, tiny: bool) -> None:
    """transformer/, vae/ and text_encoder/ (Mistral3) configs of FLUX.2-dev's shapes."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config

    Flux2Transformer2DModel(**(TINY_FLUX2_DIT if tiny else {})).save_config(str(root / "transformer"))
    AutoencoderKLFlux2(**(TINY_VAE if tiny else {})).save_config(str(root / "vae"))
    Mistral3Config(**(TINY_MISTRAL3 if tiny else {})).save_pretrained(str(root / "text_encoder"))


def _tokenizers(root: Path, folders: tuple[str, ...], chat_template: str | None = None) -> None:
    """Byte-level tokenizers (nothing downloaded); Flux.2's with a chat template, as its pipeline applies one."""
    from tests.jobs.models.diffusion.pipelines import byte_tokenizer

    for folder in folders:
        tokenizer: Any = byte_tokenizer()
        if folder == "tokenizer" and "tokenizer_2" in folders:  # Flux.1's CLIP tokenizer: 77 tokens
            tokenizer.model_max_length = 77
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(str(root / folder))


@dataclass(frozen=True)
class BenchFamily:
    """What the bench measures of one diffusion family: its pipeline's shapes, its LoRA, its rows and defaults.

    Attributes:
        name: the ``--family`` value; title: how the results name the model; section: its RESULTS.md heading.
        folder: the pipeline directory's name under the models root.
        parts: ``(root, tiny)`` writes the pipeline's configs (``init: random`` needs no weights).
        tokenizers: the tokenizer folders; chat_template: Flux.2's (its pipeline formats every prompt).
        blocks / text_encoder: how the results describe the DiT and the cache job's text encoder.
        config: the configs/ file whose ``lora`` section the rows train (None: the seed's targets, rank 32).
        prompt_tokens: the cached prompts' length at full size (Flux pads to its max_sequence_length).
        limit / budget: the defaults of ``--limit`` and ``--budget``.
        rows: the rows that apply (``ferry-streamed-modulation`` where the family precomputes its modulation; the
            encoder row needs its text encoder).
        modulation_layers: the DiT's per-block modulation layers (name fragments) that
            ``model.precompute_modulation`` takes off the link; modulation_passes_saved: how many of their two
            passes a step (forward, recomputation) it saves: both for Qwen-Image's table, which replaces them, one
            for Flux.1, which streams them once a step.
        only: the default of ``--only``.
        blocks: how the DiT's blocks are described.
    """

    name: str
    title: str
    section: str
    folder: str
    parts: Callable[[Path, bool], None]
    tokenizers: tuple[str, ...]
    config: str | None
    prompt_tokens: int
    limit: str
    budget: str
    rows: tuple[str, ...]
    only: str
    blocks: str
    text_encoder: str
    chat_template: str | None = None
    modulation_layers: tuple[str, ...] = ()
    modulation_passes_saved: int = 0

    @property
    def modulation_table(self) -> bool:
        """The family precomputes its modulation (on by default for Ferry's LoRA row)."""
        return "ferry-streamed-modulation" in self.rows

    def lora(self) -> dict[str, Any]:
        """The LoRA section the rows train: the family's config's targets and rank."""
        if self.config is None:
            return {"target_modules": SEED_TARGETS.split(","), "rank": 32}
        section = yaml.safe_load((ROOT / self.config).read_text())["lora"]
        return {"target_modules": list(section["target_modules"]), "rank": section["rank"]}


_TRAINING_ROWS = (
    "resident",
    "resident-link-busy",
    "ferry",
    "ferry-activations",
    "ferry-int8",
    "ferry-copy-all",
    "seed",
)
FLUX2_CHAT_TEMPLATE = (  # a Mistral-style template over content lists, as Flux2Pipeline's format_input builds them
    "{% for message in messages %}{% for part in message['content'] %}"
    "[{{ message['role'] }}]{{ part['text'] }}{% endfor %}{% endfor %}"
)
FAMILIES = {
    "qwen_image": BenchFamily(
        name="qwen_image",
        title="Qwen-Image",
        section=SECTION,
        folder="qwen-image-shape",
        parts=_qwen_image_parts,
        tokenizers=("tokenizer",),
        config=None,
        prompt_tokens=64,
        limit="24GiB",
        # 14GiB: what fits beside the activations under 24GiB (the job peaked at 16.1 GiB allocated, 17.5 reserved
        # with 10GiB resident); the resident blocks are spread over the step, so every one of them hides copies.
        budget="14GiB",
        rows=("encoder", *_TRAINING_ROWS, "ferry-streamed-modulation"),
        only=ONLY_DEFAULT,
        blocks="QwenImageTransformer2DModel, 60 layers",
        text_encoder="Qwen2.5-VL 7B",
        modulation_layers=("img_mod.1.", "txt_mod.1."),
        modulation_passes_saved=2,
    ),
    "flux1": BenchFamily(
        name="flux1",
        title="Flux.1-dev",
        section=f"{SECTION}: Flux.1",
        folder="flux1-dev-shape",
        parts=_flux1_parts,
        tokenizers=("tokenizer", "tokenizer_2"),
        config="configs/diffusers_transformer_flux1_lora_model-offload.yaml",
        prompt_tokens=512,
        limit="16GiB",
        # 7GiB of 16: a double block is about Qwen-Image's (0.68 GB) and the activations of 4096 + 512 tokens over
        # 57 checkpointed blocks about 1.1x Qwen-Image's, whose job peaked about 6 GiB above its budget.
        budget="7GiB",
        rows=(*_TRAINING_ROWS, "ferry-streamed-modulation"),
        only="resident,ferry,seed",
        blocks="FluxTransformer2DModel, 19 double + 38 single blocks, guidance embedding",
        text_encoder="T5-XXL",
        modulation_layers=(".norm1.linear.", ".norm1_context.linear.", ".norm.linear."),
        modulation_passes_saved=1,
    ),
    "flux2": BenchFamily(
        name="flux2",
        title="Flux.2-dev",
        section=f"{SECTION}: Flux.2",
        folder="flux2-dev-shape",
        parts=_flux2_parts,
        tokenizers=("tokenizer",),
        chat_template=FLUX2_CHAT_TEMPLATE,
        config="configs/diffusers_transformer_flux2_lora_model-offload.yaml",
        prompt_tokens=512,
        limit="24GiB",
        # 8GiB of 24: 6144 wide, the activations of 4096 + 512 tokens over 56 checkpointed blocks are about twice
        # Qwen-Image's, and a double block (1.96 GB) and the next one in flight take about 4 GB more.
        budget="8GiB",
        rows=("encoder", *_TRAINING_ROWS),
        only="encoder,resident,ferry,seed",
        blocks="Flux2Transformer2DModel, 8 double + 48 single blocks, guidance embedding",
        text_encoder="Mistral-Small-3.1 24B",
    ),
}


def make_pipeline_dir(root: Path, *, tiny: bool, family: str = "qwen_image") -> Path:
    """transformer/, text encoders', vae/ (configs only: init random) and tokenizer folders of ``family``'s shapes."""
    from accelerate import init_empty_weights

    bench = FAMILIES[family]
    with init_empty_weights():
        bench.parts(root, tiny)
    _tokenizers(root, bench.tokenizers, bench.chat_template)
    return root


def latent_shape(pipeline: Path, side: int) -> tuple[int, ...]:
    """``[C, 1, h, w]`` of a ``side`` x ``side`` image's latents as the family's cache job writes them (its VAE's
    factor and channels; Flux.2's patchified 2 x 2 into channels)."""
    import diffusers
    from accelerate import init_empty_weights

    from jobs.models.diffusion.variants import family_of

    family = family_of(pipeline)
    cls = getattr(diffusers, family.vae_class)
    with init_empty_weights():
        vae = cls.from_config(cls.load_config(str(pipeline / "vae")))
    return tuple(family.latent_shape(vae, 1, side, side))


def write_synthetic_cache(
    directory: Path, pipeline: Path, *, samples: int, side: int, prompt_tokens: int, dim: int | None = None
) -> None:
    """A complete cache of random ``side`` x ``side``-image latents whose fingerprint names this pipeline's encoders,
    with the empty caption's embedding (caption dropout) and, for Flux.1, CLIP's pooled embedding per sample."""
    from jobs.models.diffusion.variants import transformer_config

    config = transformer_config(pipeline)
    dim = dim or config["joint_attention_dim"]
    pooled_dim = config.get("pooled_projection_dim") if config["_class_name"] == "FluxTransformer2DModel" else None
    model = SimpleNamespace(
        path=pipeline, text_encoder_dtype=None, dtype="bfloat16", vae_dtype="bfloat16", init="random"
    )
    writer = CacheWriter(directory, {**model_fingerprint(model), "synthetic": True}, shard_samples=samples)
    generator = torch.Generator().manual_seed(0)
    shape = latent_shape(pipeline, side)

    def embeds() -> dict[str, torch.Tensor]:
        found = {"prompt_embeds": torch.randn((prompt_tokens, dim), generator=generator).to(torch.bfloat16)}
        if pooled_dim:
            found["pooled_prompt_embeds"] = torch.randn((pooled_dim,), generator=generator).to(torch.bfloat16)
        return found

    for index in range(samples):
        latents = torch.randn(shape, generator=generator)
        prompt = embeds()
        writer.add(
            latents,
            prompt["prompt_embeds"],
            {"source_row": index, "media": f"synthetic-{index}", "prompt": "synthetic"},
            pooled=prompt.get("pooled_prompt_embeds"),
        )
    writer.finish(embeds())


def share_one_dit_build() -> None:
    """Build the DiT once for the in-process jobs: the next job gets the same weights back on the CPU,
    without the last job's LoRA (a 20B build costs more device-machine time than the steps measured)."""
    import dataclasses

    from jobs.models import registry
    from jobs.models.diffusion.flux.modulation import flux_modulation
    from jobs.models.diffusion.modulation_table import modulation_table

    family = registry.FAMILIES["diffusers_transformer"]
    built: dict[tuple, Any] = {}

    def build(spec: Any, seed: int) -> Any:
        key = (str(spec.path), spec.init, spec.dtype, seed)
        if key not in built:
            built[key] = family.build(spec, seed)
            return built[key]
        model = built[key]
        precomputed = modulation_table(model) or flux_modulation(model)
        if precomputed is not None:  # the last job's precomputed modulation: its lookups sit inside the LoRA layers
            precomputed.remove(model)
        model.unload_lora()  # the last job's adapters; the engine was detached when that job ended
        model.disable_gradient_checkpointing()
        return model.to("cpu")

    registry.FAMILIES["diffusers_transformer"] = dataclasses.replace(family, build=build)


def run(spec_data: dict[str, Any], roots: PathRoots, output: Path) -> list[dict[str, Any]]:
    """Run one job; returns its events as dicts (raises with the job's own message when it fails)."""
    events: list[dict[str, Any]] = []
    run_job(
        load_job_spec(yaml.safe_dump(spec_data), roots),
        output_dir=output,
        report=lambda e: events.append(event_to_wire(e)),
    )
    return events


def run_through_service(spec_data: dict[str, Any], work: Path, models: Path, data: Path, timeout: float) -> list[dict]:
    """POST the job to a local ``python -m service`` and follow it over REST; returns its events' data."""
    import httpx

    from bench.local_server import start_server

    token = "bench-token"
    settings = {
        "FERRY_API_TOKEN": token,
        "FERRY_DATA_DIR": str(work / "service"),
        "FERRY_MODEL_ROOTS": str(models),
        "FERRY_DATA_ROOTS": str(data),
    }
    (work / "service").mkdir(exist_ok=True)
    process, url = start_server(work, settings)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            body, headers = yaml.safe_dump(spec_data), {"Content-Type": "application/yaml"}
            posted = client.post("/v1/jobs", content=body, headers=headers)
            if posted.status_code == 422 and "does_not_fit" in posted.text:  # the estimate is a bound: say so, go on
                print(f"fit check refused the job ({posted.text[:300]}); resubmitting with fit_check=false", flush=True)
                posted = client.post("/v1/jobs", content=body, headers=headers, params={"fit_check": "false"})
            if posted.status_code not in (200, 201, 202):
                raise RuntimeError(f"POST /v1/jobs: {posted.status_code} {posted.text[:300]}")
            job_id = posted.json()["id"]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                job = client.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(1)
            events, after = [], 0
            while True:
                page = client.get(f"/v1/jobs/{job_id}/events", params={"after": after, "limit": 1000}).json()
                events += [{"type": e["type"], **e["data"]} for e in page["data"]]
                if not page["has_more"]:
                    break
                after = page["next_cursor"]
            if job["status"] != "succeeded":
                raise RuntimeError(f"job {job_id} {job['status']}: {job.get('error')}")
            return events
    finally:
        process.terminate()
        process.wait(timeout=60)


def step_figures(events: list[dict[str, Any]], batch: int) -> dict[str, float]:
    """Median step seconds (first step excluded: warm-up) and peak device memory of a training job."""
    steps = [e for e in events if e["type"] == "step"]
    seconds = [batch / e["samples_per_s"] for e in steps[1:]] or [batch / steps[0]["samples_per_s"]]
    offload = steps[-1].get("offload") or {}
    # Per step: the link's rate over its copy time (the step before's, as the engine reports it) and the compute
    # stream's waits for copies. A slow step with a slow link is the link's; one with a full-rate link and few
    # waits is the host's.
    waits = [(e.get("offload") or {}).get("copy_wait_seconds", 0.0) for e in steps]
    return {
        "step_s": statistics.median(seconds),
        "min_step_s": min(seconds),
        "steps_s": [round(s, 3) for s in seconds],
        "peak_alloc_gib": max(e["device_peak_bytes"] for e in steps) / 2**30,
        "peak_reserved_gib": max(e["device_reserved_bytes"] for e in steps) / 2**30,
        "pinned_gib": steps[-1]["pinned_bytes"] / 2**30,
        "h2d_gb": (offload.get("last_step_h2d_bytes") or 0) / 1e9,
        # Not copied because the ring slot still held it (the turnarounds), per step after the first.
        "reused_gb": (offload.get("reused_bytes") or 0) / max(len(steps) - 1, 1) / 1e9,
        "loss": steps[-1]["loss"],
        "h2d_gbps_steps": [round((e.get("offload") or {}).get("last_step_h2d_gbps", 0.0), 1) for e in steps[1:]],
        "copy_wait_steps": [round(b - a, 3) for a, b in itertools.pairwise(waits)],
    }


def pool_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same job run in several rounds: the median and fastest over all their steps (each
    round's first step left out), the largest peaks, and each round's own median."""
    steps = [s for run in runs for s in run["steps_s"]]
    pooled = {**runs[-1], "steps_s": steps, "step_s": statistics.median(steps), "min_step_s": min(steps)}
    pooled.update({k: max(run[k] for run in runs) for k in ("peak_alloc_gib", "peak_reserved_gib")})
    pooled["round_medians_s"] = [round(run["step_s"], 3) for run in runs]
    return pooled


def dit_job(
    name: str,
    path: str,
    *,
    steps: int,
    device: str,
    offload: dict[str, Any],
    model: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A LoRA job on the DiT at ``path`` from the synthetic cache (the seed's targets at rank 32 unless ``lora``)."""
    return {
        "name": name,
        "device": device,
        "model": {
            "kind": "diffusers_transformer",
            "path": path,
            "init": "random",
            "dtype": "bfloat16",
            "vae_dtype": "bfloat16",
            **(model or {}),
        },
        "data": {"kind": "diffusion_cache", "path": "dit-cache"},
        "lora": lora or {"target_modules": SEED_TARGETS.split(","), "rank": 32},
        "training": {"steps": steps, "learning_rate": 1e-4, "gradient_checkpointing": True},
        "offload": offload,
        "checkpoint": {"save_final": False},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the family's defaults filled in (``--limit``, ``--budget``, ``--only``) and
    ``args.bench`` its BenchFamily; rows that do not apply to the family are refused, all of them at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=tuple(FAMILIES), default="qwen_image", help="the DiT's shape")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--limit", default=None, help="offload.gpu_memory_limit of the offloaded jobs (default: the family's)"
    )
    parser.add_argument(
        "--budget", default=None, help="offload.gpu_memory_budget of Ferry's schedule (default: the family's)"
    )
    parser.add_argument("--encoder-budget", default="10GiB", help="offload.gpu_memory_budget of the cache job")
    parser.add_argument("--prompts", type=int, default=16, help="samples the cache job encodes")
    # The encoder first: the DiT built once for the other rows stays on the GPU after the resident row, and
    # the cache job runs under the same gpu_memory_limit in this process.
    parser.add_argument("--only", default=None, help="what to run, in this order (default: the family's rows)")
    parser.add_argument("--seed-steps", type=int, default=2, help="steps of the (slow) seed schedule")
    parser.add_argument(
        "--tiny", "--cpu", dest="tiny", action="store_true", help="tiny shapes on the CPU: checks the script runs"
    )
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--service", action="store_true", help="submit Ferry's row over HTTP to python -m service")
    parser.add_argument(
        "--service-rows",
        default="ferry",
        help="with --service: the rows submitted over HTTP (resident,ferry: the resident row pays the service's "
        "job process too, so the ratio compares like with like)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the training rows of --only this many times, interleaved (resident, ferry, resident, ferry, ...): "
        "a noisy host moves a row's median by tens of percent from one job to the next, so the ratio is taken "
        "over all rounds' steps, and each round's pair is shown",
    )
    parser.add_argument("--build-each", action="store_true", help="build the DiT afresh for every job")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    bench = args.bench = FAMILIES[args.family]
    args.limit, args.budget = args.limit or bench.limit, args.budget or bench.budget
    args.only = args.only or bench.only
    wrong = [key for key in args.only.split(",") if key not in bench.rows]
    if wrong:
        parser.error(f"--only {','.join(wrong)}: not a row of --family {args.family}; its rows: {','.join(bench.rows)}")
    return args


def main() -> None:
    args = parse_args()
    bench = args.bench
    device = "cpu" if args.tiny else "cuda"
    side = 64 if args.tiny else 1024
    work = Path(args.work or tempfile.mkdtemp(prefix="ferry-diffusion-bench-"))
    models, data = work / "models", work / "data"
    data.mkdir(parents=True, exist_ok=True)
    pipeline = make_pipeline_dir(models / bench.folder, tiny=args.tiny, family=bench.name)
    roots = PathRoots(model_roots=[models], data_roots=[data])
    h2d = pinned_h2d_gbps() if device == "cuda" else float("nan")
    prompt_tokens = 64 if args.tiny else bench.prompt_tokens
    write_synthetic_cache(data / "dit-cache", pipeline, samples=4, side=side, prompt_tokens=prompt_tokens)
    from jobs.models.diffusion.family import meta_dit

    probe = load_job_spec(
        yaml.safe_dump(dit_job("probe", bench.folder, steps=1, device=device, offload={}, lora=bench.lora())), roots
    )
    shapes = meta_dit(probe.model)
    weights = sum(p.numel() for p in shapes.parameters())
    weight_bytes = 2 * weights
    # The per-block modulation layers model.precompute_modulation takes off the link: Qwen-Image's img_mod.1 and
    # txt_mod.1 (both passes), Flux.1's norm*.linear (the recomputation's pass); Flux.2 has none.
    modulation_bytes = 2 * sum(
        p.numel() for n, p in shapes.named_parameters() if any(layer in n for layer in bench.modulation_layers)
    )
    limited = {} if args.tiny else {"gpu_memory_limit": args.limit}
    ferry = {
        "enable_model_cpu_offload": True,
        "granularity": "block",
        "prefetch": 1,
        "gpu_memory_budget": None if args.tiny else args.budget,
        **limited,
    }
    configs = {
        "resident": ("no offload, no limit (weights resident)", {}),
        # The resident job while copies it does not make keep the link busy: what a step's copies cost the
        # host apart from the engine's own work (bench/copy_load.py).
        "resident-link-busy": ("no offload, no limit, link busy (host-to-device copies in the background)", {}),
        "ferry": (
            f"model offload, block units, prefetch 1, {'modulation precomputed, ' if bench.modulation_table else ''}"
            f"budget {args.budget}, limit {args.limit}",
            ferry,
        ),
        # Ferry's schedule with the modulation layers streamed like the rest: the same-run baseline of the table.
        "ferry-streamed-modulation": (
            f"as Ferry's, precompute_modulation: false (every weight streams), budget {args.budget}, limit {args.limit}",
            ferry,
            {"precompute_modulation": False},
        ),
        # Ferry's schedule with the checkpointed block inputs in pinned host memory: with --budget auto the budget
        # takes the device memory they leave (the forward's device-to-host copies use the link's other direction).
        "ferry-activations": (
            f"as Ferry's, offload.activations: true, budget {args.budget}, limit {args.limit}",
            {**ferry, "activations": True},
        ),
        # Ferry's schedule with the frozen weights stored and streamed in int8 (half the bytes on the link): the
        # candidate where the forward is bound by the link (Flux.2 under 24 GiB), beside the bf16 resident row.
        "ferry-int8": (
            f"as Ferry's, model.quantize: int8 (frozen weights streamed in int8), budget {args.budget}, limit {args.limit}",
            ferry,
            {"quantize": "int8"},
        ),
        # The same schedule with every visit copied: the same-run baseline of the ring slots' reuse.
        "ferry-copy-all": (
            f"as Ferry's, reuse_ring_slots: false (every visit copies), budget {args.budget}, limit {args.limit}",
            {**ferry, "reuse_ring_slots": False},
        ),
        "seed": (
            f"the seed's schedule: leaf units, prefetch 0, limit {args.limit}",
            # The seed copies on every visit: no ring slot reuse (ring.py).
            {
                "enable_model_cpu_offload": True,
                "granularity": "leaf",
                "prefetch": 0,
                "reuse_ring_slots": False,
                "gpu_memory_budget": None,  # streams every weight
                **limited,
            },
            # The seed streams every weight (Flux's DiTs have no table to switch off).
            {"precompute_modulation": False} if bench.modulation_table else None,
        ),
    }
    if not args.build_each:
        share_one_dit_build()
    rows, failures, encoder = {}, {}, None
    rounds: dict[str, list[dict[str, Any]]] = {}

    def rendered() -> str:
        return render(
            rows,
            failures,
            encoder,
            h2d=h2d,
            weights=weights,
            weight_bytes=weight_bytes,
            modulation_bytes=modulation_bytes,
            args=args,
            device=device,
        )

    order = args.only.split(",")
    order += [key for key in order if key != "encoder"] * (args.rounds - 1)
    for key in order:  # in the order given: a run cut short keeps the first rows
        if key == "encoder":
            try:
                encoder = cache_throughput(roots, data, pipeline, args, device, limited, side)
            except Exception as error:
                failures["encoder"] = f"{type(error).__name__}: {error}"[:400]
            print("encoder", encoder or failures["encoder"], flush=True)
        else:
            rows_or_failure(key, configs[key], rows, failures, args, device, work, models, data, roots)
            if key in rows and "round_medians_s" not in rows[key]:
                rounds.setdefault(key, []).append(rows[key])
                rows[key] = pool_rounds(rounds[key])
        if not args.no_write:  # after every row: a run cut short still leaves what it measured
            write_section(rendered(), bench.section)
        gc.collect()  # the finished job's model and engine hold reference cycles (hooks)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # each row's peak is its own, not the resident row's
    report = rendered()
    print("\n" + report)
    if not args.no_write:
        write_section(report, bench.section)
    (work / "results.json").write_text(
        json.dumps({"rows": rows, "failures": failures, "encoder": encoder, "h2d_gbps": h2d}, indent=1)
    )


def rows_or_failure(
    key: str,
    config: tuple,
    rows: dict,
    failures: dict,
    args: Any,
    device: str,
    work: Path,
    models: Path,
    data: Path,
    roots: PathRoots,
) -> None:
    """Run one DiT schedule and record its figures (or why it failed) under ``key``."""
    label, offload, model = (*config, None)[:3]
    bench = args.bench
    offload = {k: v for k, v in offload.items() if v is not None}
    started = time.perf_counter()
    try:
        steps = args.seed_steps if key == "seed" else args.steps
        job = dit_job(key, bench.folder, steps=steps, device=device, offload=offload, model=model, lora=bench.lora())
        link_busy = key == "resident-link-busy"
        load = BackgroundCopies(directions=("h2d",)) if link_busy and device == "cuda" else None
        try:
            if args.service and key in args.service_rows.split(","):
                events = run_through_service(job, work, models, data, timeout=540)
                label += " — through the service (POST /v1/jobs)"
            else:
                events = run(job, roots, work / f"out-{key}")
        finally:
            if load is not None:
                load.stop()
        busy = {"load_gbps": load.gbps()} if load is not None else {}
        if link_busy and load is None:
            label += " — no GPU here, so no copies ran"
        rows[key] = {"label": label, **step_figures(events, 1), **busy, "job_s": time.perf_counter() - started}
    except Exception as error:  # reported beside the others, not fatal
        failures[key] = f"{type(error).__name__}: {error}"[:400]
    print(key, rows.get(key) or failures[key], flush=True)


def cache_throughput(
    roots: PathRoots, data: Path, pipeline: Path, args: Any, device: str, limited: dict, side: int
) -> dict:
    """A task: cache job over ``--prompts`` 1024 x 1024 images: samples/s overall and in the text encoder."""
    from PIL import Image

    folder = data / "images"
    folder.mkdir(exist_ok=True)
    ramp = torch.linspace(0, 255, side).to(torch.uint8)
    pixels = torch.stack([ramp.expand(side, side), ramp.expand(side, side).T, ramp.flip(0).expand(side, side)], -1)
    prompt = "a watercolor painting of a lighthouse on a rocky coast at dawn, gulls, soft pink light"
    lines = ["image,prompt"]
    for index in range(args.prompts):
        Image.fromarray(pixels.numpy()).save(folder / f"{index}.png")
        lines.append(f"{index}.png,{prompt} {index}")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    spec = {
        "name": "encoder-cache",
        "device": device,
        "task": "cache",
        "model": {
            "kind": "diffusers_transformer",
            "path": pipeline.name,
            "init": "random",
            "dtype": "bfloat16",
            "vae_dtype": "bfloat16",
        },
        "data": {"kind": "image_caption", "path": "images", "max_pixels": side * side},
        "cache": {"path": "encoder-cache", "shard_samples": 8},
        "offload": {
            "enable_model_cpu_offload": True,
            "granularity": "block",
            "prefetch": 1,
            "gpu_memory_budget": None if args.tiny else args.encoder_budget,
            **limited,
        },
    }
    started = time.perf_counter()
    events = run(spec, roots, data.parent / "out-encoder")
    progress = [e for e in events if e["type"] == "cache_progress"]
    last = progress[-1]
    # Byte-level tokenizer: one token per byte of the prompt; Flux's pipelines pad every prompt to 512 tokens.
    tokens = len(prompt) + 2 if args.bench.name == "qwen_image" else args.bench.prompt_tokens
    return {
        "samples": last["step"],
        "samples_per_s": last["samples_per_s"],
        "text_encoder_samples_per_s": last["step"] / last["text_encoder_s"],
        "text_encoder_s": last["text_encoder_s"],
        "vae_s": last["vae_s"],
        "prompt_tokens": tokens,
        "peak_alloc_gib": max(e["device_peak_bytes"] for e in progress) / 2**30,
        "peak_reserved_gib": max(e["device_reserved_bytes"] for e in progress) / 2**30,
        "job_s": time.perf_counter() - started,
    }


def render(
    rows: dict,
    failures: dict,
    encoder: dict | None,
    *,
    h2d: float,
    weights: int,
    weight_bytes: int,
    modulation_bytes: int,
    args: Any,
    device: str,
) -> str:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (--tiny check)"
    bench = FAMILIES[args.family]
    floor_all = 2 * weight_bytes / (h2d * 1e9)
    from offload import parse_bytes

    if args.budget == "auto":  # the engine chose the budget: the floor is the bytes Ferry's row copied per step
        copied = rows.get("ferry", {}).get("h2d_gb", float("nan"))
        floor_budget = copied / h2d
        floor_streamed = floor_budget
    else:
        budget = parse_bytes(args.budget) or 0
        # Ferry's row streams every weight twice but the modulation layers (and those the budget keeps), which
        # cross the link as often as precompute_modulation leaves them to.
        once_more = (2 - bench.modulation_passes_saved) * modulation_bytes
        floor_budget = (2 * max(weight_bytes - modulation_bytes - budget, 0) + once_more) / (h2d * 1e9)
        floor_streamed = 2 * max(weight_bytes - budget, 0) / (h2d * 1e9)
    resident = rows.get("resident", {}).get("step_s")
    lines = [
        f"{bench.section}\n",
        f"{datetime.date.today()} — {gpu} — torch {torch.__version__} — commit {commit()}\n",
        f"Reproduce: `python bench/diffusion_bench.py{'' if bench.name == 'qwen_image' else f' --family {bench.name}'} --steps {args.steps} --seed-steps {args.seed_steps} "
        f"--prompts {args.prompts} --limit {args.limit} --budget {args.budget}{f' --service --service-rows {args.service_rows}' if args.service else ''}"
        f"{'' if args.only == bench.only else f' --only {args.only}'}"
        f"{f' --rounds {args.rounds}' if args.rounds > 1 else ''}`\n",
        f"DiT of {bench.title}'s shape ({bench.blocks}, {weights / 1e9:.2f}B parameters, "
        f"{weight_bytes / 1e9:.1f} GB bf16, random init), {lora_words(bench)}, gradient "
        f"checkpointing, batch 1 from a synthetic cache of 1024 x 1024 latents (4096 image + {bench.prompt_tokens} "
        f"prompt tokens). Pinned host-to-device copy measured in this run: {h2d:.1f} GB/s. Copy floor = the streamed "
        f"weights twice / that rate: all weights {floor_all:.2f} s; with {args.budget} kept resident {floor_streamed:.2f} s"
        + (
            (
                f", and without the {modulation_bytes / 1e9:.1f} GB of modulation layers the table replaces"
                if bench.modulation_passes_saved == 2
                else f", and with the {modulation_bytes / 1e9:.1f} GB of per-block modulation layers streamed once"
            )
            + f" {floor_budget:.2f} s"
            if bench.modulation_table
            else ""
        )
        + (" (auto: Ferry's bytes copied per step / that rate). " if args.budget == "auto" else ". ")
        + "Step = median of the steps after the first. Each row is a real job: a row marked so went through the "
        "service (POST /v1/jobs, its worker's child process), the others through `jobs.run_job` in the bench's "
        "process (the function that child calls)"
        + ("" if args.build_each else ", which build the DiT once and hand it from job to job")
        + ".\n",
        "| schedule | step (s) | vs resident | vs copy floor | peak allocated (GiB) | peak reserved (GiB) | pinned host (GiB) | H2D per step (GB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        floor = {
            "ferry": floor_budget,
            "ferry-copy-all": floor_budget,
            "ferry-activations": floor_budget,
            "ferry-int8": float("nan"),  # its bytes are int8, not the floors' bf16
            "ferry-streamed-modulation": floor_streamed,
        }.get(key, floor_all)
        vs_resident = f"{row['step_s'] / resident:.2f}x" if resident and key != "resident" else "—"
        vs_floor = f"{row['step_s'] / floor:.2f}x" if key != "resident" and floor == floor else "—"
        lines.append(
            f"| {row['label']} | {row['step_s']:.2f} | {vs_resident} | {vs_floor} | {row['peak_alloc_gib']:.1f} | "
            f"{row['peak_reserved_gib']:.1f} | {row['pinned_gib']:.1f} | {row['h2d_gb']:.1f} |"
        )
    for key, message in failures.items():
        lines.append(f"| {key} | failed: {message} | | | | | | |")
    if "ferry" in rows and resident:
        bound = max(resident, floor_budget)
        ferry = rows["ferry"]
        lines.append(
            f"\nTarget: Ferry's step <= 1.10 x max(resident step, copy floor) = {1.10 * bound:.2f} s; "
            f"measured {ferry['step_s']:.2f} s ({ferry['step_s'] / bound:.2f}x). Fastest steps: Ferry "
            f"{ferry['min_step_s']:.2f} s, resident {rows['resident']['min_step_s']:.2f} s "
            f"({ferry['min_step_s'] / max(rows['resident']['min_step_s'], floor_budget):.2f}x)."
        )
        for key in ("resident", "ferry"):
            lines.append(f"{key} steps after the first (s): {', '.join(f'{s:.2f}' for s in rows[key]['steps_s'])}")
        pairs = list(zip(rows["resident"]["round_medians_s"], ferry["round_medians_s"], strict=False))
        if len(pairs) > 1:
            lines.append(
                "Each round's medians (resident, Ferry; Ferry / max(resident, copy floor)): "
                + "; ".join(f"{r:.2f}, {f:.2f} ({f / max(r, floor_budget):.2f}x)" for r, f in pairs)
            )
        lines.append(f"Ferry's link rate per step (GB/s): {', '.join(f'{g:.0f}' for g in ferry['h2d_gbps_steps'])}")
        lines.append(f"Ferry's copy waits per step (s): {', '.join(f'{w:.2f}' for w in ferry['copy_wait_steps'])}")
        lines.append(
            f"Ferry's weights reused from their ring slots instead of copied: {ferry['reused_gb']:.2f} GB/step"
        )
    if resident and "resident-link-busy" in rows:
        busy = rows["resident-link-busy"]
        lines.append(
            f"Link busy, same run: the resident step {resident:.2f} s alone, {busy['step_s']:.2f} s while host-to-device "
            f"copies ran in the background at {busy.get('load_gbps', float('nan')):.0f} GB/s "
            f"({busy['step_s'] / resident:.2f}x): what the copies alone cost the host's step, apart from the engine."
        )
    for key, what, baseline in (
        ("ferry-streamed-modulation", "Precomputed modulation", "with the modulation layers streamed"),
        ("ferry-copy-all", "Ring slot reuse", "every visit copied"),
        ("ferry-activations", "Activations on the host", "offload.activations: true"),
        ("ferry-int8", "Frozen weights in int8", "model.quantize: int8"),
    ):
        if "ferry" in rows and key in rows:  # Ferry's row beside its same-run A/B row
            ferry, other = rows["ferry"], rows[key]
            lines.append(
                f"{what}, same run: Ferry {ferry['step_s']:.2f} s copying {ferry['h2d_gb']:.1f} GB per step; "
                f"{baseline} {other['step_s']:.2f} s, {other['h2d_gb']:.1f} GB ({ferry['step_s'] / other['step_s']:.2f}x)."
            )
    if encoder:
        lines.append(
            f"\nCache job (`task: cache`) with a text encoder of {bench.text_encoder}'s shape (random init, bf16) under "
            f"the same limit through the offload engine (block units, budget {args.encoder_budget}), {encoder['samples']} "
            f"1024 x 1024 images, {encoder['prompt_tokens']}-token prompts: {encoder['samples_per_s']:.2f} samples/s "
            f"overall; text encoder alone {encoder['text_encoder_samples_per_s']:.2f} samples/s "
            f"({encoder['text_encoder_s']:.1f} s), VAE {encoder['vae_s']:.1f} s; peak allocated "
            f"{encoder['peak_alloc_gib']:.1f} GiB, reserved {encoder['peak_reserved_gib']:.1f} GiB."
        )
    return "\n".join(lines) + "\n"


def lora_words(bench: BenchFamily) -> str:
    """The rows' LoRA, as the results describe it."""
    lora = bench.lora()
    where = "the seed's" if bench.config is None else f"{bench.config}'s"
    return f"LoRA rank {lora['rank']} on {where} {len(lora['target_modules'])} targets"


def write_section(report: str, section: str = SECTION) -> None:
    """Replace (or add) this benchmark's ``section`` of bench/RESULTS.md, leaving the others as they are (the
    heading matched as a whole line: Qwen-Image's is the start of the Flux sections' headings)."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    heading = f"\n{section}\n"
    if heading in "\n" + text:
        start = ("\n" + text).index(heading)  # the heading's first character in text
        # The section ends where the next one starts (its heading, or the marker comment some sections open
        # with) or at its first subsection: the "### " notes written by hand below the generated part stay.
        after = start + len(section)
        ends = [
            i for i in (text.find("\n## ", after), text.find("\n### ", after), text.find("\n<!-- ", after)) if i != -1
        ]
        end = min(ends) if ends else -1
        text = text[:start] + report + (text[end + 1 :] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + report
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
