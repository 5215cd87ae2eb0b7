"""``model.precompute_modulation``: which jobs compute the DiT's per-block modulation ahead, and how.

Two families have per-block modulation layers whose inputs need no gradient under LoRA:

- Qwen-Image's (``img_mod.1``, ``txt_mod.1``) sees the timestep alone: a table per timestep, computed once before
  training and kept in host memory; the layers leave the model (modulation_table.py).
- Flux.1's (``norm1.linear``, ``norm1_context.linear``, ``norm.linear``) sees the timestep, the guidance and the
  pooled text: every block's rows are computed once per DiT call from its ``temb``, the layers streamed once a
  step in units of their own instead of with their blocks in the forward and again in the recomputation
  (flux/modulation.py).

On by default for a LoRA job under model offload whose DiT allows it; the registry entry (family.py) calls these.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from jobs.errors import Problem
from jobs.models.diffusion.variants import family_of as pipeline_family
from jobs.models.diffusion.variants import transformer_config

if TYPE_CHECKING:
    from jobs.models.diffusion.modulation_table import ModulationTable
    from jobs.models.diffusion.spec import DiffusionJobSpec

log = logging.getLogger(__name__)


def uses_precomputed_modulation(spec: DiffusionJobSpec) -> bool:
    """``model.precompute_modulation``, or by default: a LoRA job under model offload whose DiT allows it."""
    model: Any = spec.model
    if model.precompute_modulation is not None:
        return bool(model.precompute_modulation)
    return (
        spec.offload.enable_model_cpu_offload
        and spec.lora is not None
        and modulation_problem(transformer_config(model.path)) is None
    )


def modulation_problem(config: dict[str, Any]) -> str | None:
    """Why this DiT's modulation cannot be precomputed, or None (Qwen-Image's without extra conditioning, Flux.1's)."""
    from jobs.models.diffusion.flux.modulation import flux_modulation_problem
    from jobs.models.diffusion.modulation_table import modulation_problem as table_problem

    name = config.get("_class_name")
    if name == "QwenImageTransformer2DModel":
        return table_problem(config)
    if name in ("FluxTransformer2DModel", "Flux2Transformer2DModel"):
        return flux_modulation_problem(config)
    return f"only Qwen-Image's and Flux.1's DiTs have per-block modulation layers to precompute; got {name}"


def install_precomputed_modulation(
    spec: DiffusionJobSpec, model: nn.Module, timesteps: Any, device: torch.device
) -> ModulationTable | None:
    """Install the job's precomputed modulation on ``model`` (before the engine attaches). Returns Qwen-Image's
    table, whose rows each batch carries; None for Flux.1 (each DiT call computes its rows), for a job that does
    not precompute, and (with a warning) when the default would need a layer that trains (``true`` fails instead)."""
    if not uses_precomputed_modulation(spec):
        return None
    from jobs.models.diffusion.flux import modulation as flux
    from jobs.models.diffusion.modulation_table import trained_modulation

    per_call = pipeline_family(spec.model.path).name == "flux1"
    trained = (flux.trained_modulation if per_call else trained_modulation)(model)
    if trained is not None and spec.model.precompute_modulation is None:
        log.warning("model.precompute_modulation is off for this job: %s", trained)
        return None
    if per_call:
        log.info("the DiT's modulation is computed once per call: %s", flux.FluxModulation.install(model))
        return None
    return _modulation_table(spec, model, timesteps, device)


def _modulation_table(spec: DiffusionJobSpec, model: nn.Module, timesteps: Any, device: torch.device) -> Any:
    """The table for the timesteps training draws and the samples' Euler steps, installed on ``model``."""
    from accelerate.utils import get_mixed_precision_context_manager

    from jobs.models.diffusion.flow_match import sigmas
    from jobs.models.diffusion.modulation_table import precompute_modulation

    wanted = [timesteps.sigmas[timesteps.first : timesteps.last]]
    if spec.sample is not None:
        wanted.append(sigmas(timesteps.family, spec.sample.num_inference_steps))
    mixed = spec.training.mixed_precision != "no"
    # The forward's own autocast (accelerator.autocast() in train_step), so each row is the value it computes.
    autocast = (lambda: get_mixed_precision_context_manager(True)) if mixed else contextlib.nullcontext
    started = time.perf_counter()
    table = precompute_modulation(model, torch.cat(wanted).float(), device, autocast)
    log.info("precomputed the DiT's modulation in %.1f s: %s", time.perf_counter() - started, table)
    return table


def drop_precomputed_modulation(spec: DiffusionJobSpec, model: nn.Module) -> None:
    """For the fit check, when the job precomputes the modulation: the meta DiT without the layers a table
    replaces (Qwen-Image: they never reach the device), or with Flux.1's in units of their own (streamed once)."""
    if not uses_precomputed_modulation(spec):
        return
    if pipeline_family(spec.model.path).name == "flux1":
        from jobs.models.diffusion.flux.modulation import FluxModulation

        FluxModulation.separate(model)
        return
    from jobs.models.diffusion.modulation_table import STREAMS

    blocks: Any = model.transformer_blocks
    for block in blocks:
        for name in STREAMS:
            getattr(block, name)[1] = nn.Identity()


def check_precompute_modulation(spec: DiffusionJobSpec) -> list[Problem]:
    """``precompute_modulation: true`` where it cannot apply: a DiT without such layers, a full fine-tune, or a
    LoRA on the modulation's input (refused at submit; the default just streams those layers)."""
    if not getattr(spec.model, "precompute_modulation", None):
        return []
    problem = modulation_problem(transformer_config(spec.model.path))
    if problem is None and spec.lora is None:
        from jobs.models.diffusion.flux.modulation import LAYER_NAMES

        flux = pipeline_family(spec.model.path).name == "flux1"
        layers, what = (LAYER_NAMES, "the precomputed modulation") if flux else ("img_mod.1 and txt_mod.1", "the table")
        problem = f"a full fine-tune trains {layers}; {what} needs them frozen (add a lora section)"
    if problem is None:
        problem = _trained_time_embedding(spec)
    return [("model.precompute_modulation", f"{problem}; set it to false or leave it out")] if problem else []


def _trained_time_embedding(spec: DiffusionJobSpec) -> str | None:
    """The LoRA target that would train the modulation's input (``time_text_embed``), or None."""
    from jobs.models.diffusion.family import meta_dit
    from jobs.models.family import linear_module_names, lora_target_matches

    assert spec.lora is not None, "a full fine-tune is refused before"
    for name in linear_module_names(meta_dit(spec.model)):
        matched = [t for t in spec.lora.target_modules if lora_target_matches(name, t)]
        if name.startswith("time_text_embed.") and matched:
            return f"lora.target_modules {matched[0]!r} trains {name}, the modulation's input, which must stay frozen"
    return None
