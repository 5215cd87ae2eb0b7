"""``model.tiled_mlp``: a decoder layer's MLP over checkpointed tiles of the sequence.

Losses bitwise those of the untiled model; gradients to float rounding (an adapter's weight gradient sums its
tokens tile by tile, another order of the same sum): with LoRA on gate/up/down, under the layers' reentrant
checkpointing, the offload engine (leaf and block units, weights read from the device copies in every
recompute), activation offload and DPO's masked reference rows. A backward holds one tile's intermediates at
a time, and the fit check counts one tile's.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from jobs import PathRoots, estimate_memory
from jobs.errors import JobSpecError
from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
from jobs.objectives.preference import PreferenceLoss
from jobs.recompute import apply_activation_checkpointing, offload_checkpointed_inputs, tiled_mlp
from jobs.spec.llm import DPOSpec, ORPOSpec
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")

TILE = 16  # tokens: 2 rows x 8 positions; a 2 x 40-token batch runs as 5 tiles
TARGETS = ["q_proj", "gate_proj", "up_proj", "down_proj"]


def _model(tiled: bool, checkpointing: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    if tiled:
        tiled_mlp.install(model, TILE)
    if checkpointing:
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
    lora = LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)  # adapters that change the output
    return get_peft_model(model, lora).train()


Trained = tuple[float, dict[str, torch.Tensor]]


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, manager: OffloadTrainingManager | None = None) -> Trained:
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if manager is not None:
        manager.after_backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(tiled: Trained, whole: Trained, *, exact_loss: bool = True, atol: float = 1e-7) -> None:
    assert tiled[0] == whole[0] if exact_loss else tiled[0] == pytest.approx(whole[0], rel=1e-6)
    assert tiled[1].keys() == whole[1].keys() and len(whole[1]) == 3 * 4 * 2
    for name, grad in whole[1].items():
        torch.testing.assert_close(tiled[1][name], grad, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("granularity", [None, "leaf", "block"])
def test_tiles_train_as_the_whole_mlp(checkpointing: bool, granularity: str | None) -> None:
    whole = _step(_model(False, checkpointing))
    model = _model(True, checkpointing)
    manager = (
        OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity)) if granularity else None
    )
    _assert_same_training(_step(model, manager), whole)


def test_activation_offload_with_tiles_trains_as_the_whole_mlp() -> None:
    whole = _step(_model(False, True))
    model = _model(True, True)
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", offload_activations=True)
    )
    assert manager.activations is not None and offload_checkpointed_inputs(model, manager.activations) >= 3
    _assert_same_training(_step(model, manager), whole)
    assert manager.activations.offloaded_bytes > 0


@pytest.mark.parametrize(("tiled", "checkpointing"), [(True, True), (True, False), (False, True)])
def test_the_recompute_reads_the_weights_device_copies(tiled: bool, checkpointing: bool) -> None:
    """Block units: the engine hooks the decoder layer, and its hooks bring the weights back for the recompute.
    transformers after 5.17 checkpoints a layer's ``forward`` with the hooks outside, so every recomputed call
    read the host copies (a device mismatch on a GPU) until ``checkpoint_layer`` ran the hooks inside; and a
    tile's checkpoint keeps the weights it saves from the engine. On the CPU a host copy holds the same
    values, so only the pointers tell."""
    model = _model(tiled, checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block"))
    offloaders = {id(o.tensor): o for unit in manager.units for o in unit.offloaders if hasattr(o, "host")}
    reads: list[bool] = []

    def read(module: nn.Module, _args: Any) -> None:
        offloader = offloaders.get(id(module.weight))
        if offloader is not None and torch._C._current_graph_task_id() != -1:  # in backward: a recompute
            reads.append(module.weight.data_ptr() == offloader.host.data_ptr())

    for name, module in model.named_modules():
        if name.endswith(("q_proj.base_layer", "gate_proj.base_layer", "up_proj.base_layer", "down_proj.base_layer")):
            module.register_forward_pre_hook(read)
    _step(model, manager)
    assert reads and not any(reads), f"{sum(reads)} of {len(reads)} recomputed calls read the host copy"


def test_a_backward_holds_one_tiles_intermediates_at_a_time() -> None:
    model = _model(True, True)
    mlp = model.base_model.model.model.layers[1].mlp
    alive: list[weakref.ref] = []
    seen: list[tuple[int, int]] = []  # (rows reaching down_proj, intermediates of earlier recomputes alive)

    def record(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:
            alive.append(weakref.ref(output))

    def count(_module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            seen.append((args[0].shape[0] * args[0].shape[1], sum(ref() is not None for ref in alive[:-1])))

    mlp.up_proj.register_forward_hook(record)
    mlp.down_proj.register_forward_pre_hook(count)
    _step(model)
    assert len(seen) == 5  # each tile's recompute (the layer's recompute no longer runs the MLP)
    assert max(rows for rows, _ in seen) == TILE
    assert all(earlier == 0 for _, earlier in seen), seen  # a tile's recompute starts after the last one's backward


def _mlp_tokens(model: nn.Module) -> list[int]:
    """Tokens each decoder layer's down projection ran, forward and backward, over one training step."""
    seen: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith("mlp.down_proj"):
            count = functools.partial(
                lambda key, _m, args: seen.update({key: seen.get(key, 0) + args[0].shape[1]}), name
            )
            hooks.append(module.register_forward_pre_hook(count))
    _step(model)
    for hook in hooks:
        hook.remove()
    return list(seen.values())


def test_a_checkpointed_layers_recompute_skips_its_tiled_mlp() -> None:
    """The MLP's output goes only into the residual sum, so the layer's recompute, whose outputs backward reads no
    value of, returns zeros for it: two MLP forwards a step (the layer's forward, each tile's recompute), not
    three, for the same training."""
    tokens = _ids().shape[1]
    assert _mlp_tokens(_model(True, True)) == [2 * tokens] * 3
    assert _mlp_tokens(_model(False, True)) == [2 * tokens] * 3  # a whole MLP: forward and recompute
    assert _mlp_tokens(_model(True, False)) == [2 * tokens] * 3  # no layer checkpoint: each tile's own
    _assert_same_training(_step(_model(True, True)), _step(_model(False, True)))


def test_a_layer_that_normalizes_its_mlps_output_still_computes_it() -> None:
    """Gemma 2 normalizes the MLP's output before the residual sum: that norm's backward reads the value, so the
    recompute computes it (three forwards) and the gradients are the whole MLP's."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def gemma(tiled: bool) -> nn.Module:
        torch.manual_seed(0)
        config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
        model = Gemma2ForCausalLM(config)
        if tiled:
            tiled_mlp.install(model, TILE)
            assert all(not mlp.ferry_tiled_mlp.residual_last for _, mlp in tiled_mlp.tileable_mlps(model))
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
        return get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)).train()

    tokens = _ids().shape[1]
    assert _mlp_tokens(gemma(True)) == [3 * tokens] * 3
    _assert_same_training(_step(gemma(True)), _step(gemma(False)))


def test_the_skipped_recompute_replays_the_forwards_dropout() -> None:
    """With LoRA dropout the tiles draw masks: the tiles recomputed in backward draw the layer's forward's, so the
    step is the one that computes the recompute's MLP: the loss bitwise, each adapter's gradient to the rounding of
    its tiles' sum (taken in the other order)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def dropped(skip: bool) -> Trained:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        model = LlamaForCausalLM(config)
        tiled_mlp.install(model, TILE)
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
        lora = LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.3)
        model = get_peft_model(model, lora).train()
        with pytest.MonkeyPatch.context() as patch:
            if not skip:
                patch.setattr(tiled_mlp, "recomputing", lambda: False)
            torch.manual_seed(5)
            return _step(model)

    skipped, computed = dropped(True), dropped(False)
    assert skipped[0] == computed[0] and skipped[1].keys() == computed[1].keys()
    for name, grad in computed[1].items():
        # Other masks would move these gradients (up to 0.13) by about 1e-2; the tiles' sum order, by 1e-8.
        torch.testing.assert_close(skipped[1][name], grad, rtol=0, atol=5e-8, msg=name)


def test_dpo_masks_the_reference_rows_in_every_tile() -> None:
    # DPO doubles the rows (policy, then reference) and zeroes the adapters' output on the reference rows by a
    # hook on each lora_B; a tile keeps every row, so the hook masks the same rows in the recompute.
    training = SimpleNamespace(objective="dpo", dpo=DPOSpec(), orpo=ORPOSpec())
    ids = _ids()
    labels = ids.clone()
    labels[:, :10] = -100  # the prompt
    batch = {"input_ids": torch.cat([ids, ids.flip(1)]), "labels": torch.cat([labels, labels.flip(1)])}

    def step(model: nn.Module) -> Trained:
        loss = PreferenceLoss(training, model)(model, batch)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, tiled = step(_model(False, True)), step(_model(True, True))
    assert whole[0] != pytest.approx(0.6931, abs=1e-4)  # the adapters move the policy off the reference
    # Eight rows: two positions a tile, whose rows the CPU's matmul rounds differently, and twenty tiles' sums in
    # each adapter's gradient (unmasked reference rows would move these gradients by about 1e-2).
    _assert_same_training(tiled, whole, exact_loss=False, atol=1e-6)


def test_remove_leaves_the_model_as_it_was() -> None:
    model = _model(False, False).base_model.model
    keys = list(model.state_dict())
    assert tiled_mlp.install(model, TILE) == 3
    assert list(model.state_dict()) == keys and all("forward" in m.__dict__ for _, m in tiled_mlp.tileable_mlps(model))
    tiled_mlp.remove(model)
    assert all("forward" not in m.__dict__ and not hasattr(m, "ferry_tiled_mlp") for m in model.modules())


def test_mixtures_of_experts_keep_their_mlps_whole() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    with torch.device("meta"):
        assert tiled_mlp.tileable_mlps(MixtralForCausalLM(config)) == []


# ---- the job: spec, estimate, training ------------------------------------------------------------------
QWEN_32B = dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768)  # fmt: skip
LONG = {
    "name": "long",
    "device": "cuda",
    "model": {"kind": "hf_causal_lm", "path": "qwen-32b", "dtype": "bfloat16", "init": "random"},
    "data": {"kind": "text", "path": "corpus", "seq_len": 32768},
    "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             "rank": 16},
    "training": {"steps": 5, "gradient_checkpointing": True},
    "offload": {"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": "24GiB",
                "activations": True, "gpu_memory_budget": None},  # the streamed peaks compared
}  # fmt: skip


def test_a_32b_lora_at_32k_tokens_fits_24_gib_once_its_mlps_are_tiled(roots: PathRoots) -> None:
    from transformers import Qwen2Config

    Qwen2Config(**QWEN_32B).save_pretrained(roots.model_roots[0] / "qwen-32b")
    whole = estimate_memory(spec_from(merged(LONG, model={"tiled_mlp": False}), roots)).peak_device_bytes
    tiled = estimate_memory(spec_from(LONG, roots)).peak_device_bytes  # auto: checkpointed, 32768 > 2048 tokens
    assert whole > 24 * 2**30 > tiled
    # The whole MLP's intermediates (4 x 27648 per token, bf16) against one 2048-token tile's, twice (recompute
    # and backward), in the layer's backward.
    assert whole - tiled == 2 * (32768 - 2048) * 4 * 27648 * 2
    assert tiled_mlp.default_tile_tokens(27648, 2) == 2048


@pytest.mark.parametrize("tokens", [4096, 32768])
def test_auto_tiles_only_where_the_job_needs_it_to_fit(roots: PathRoots, tokens: int) -> None:
    # Tiling costs one more MLP forward a step: a 32B LoRA at 4096 tokens fits 24 GiB with whole MLPs and keeps
    # them; at 32768 tokens it does not, and auto tiles.
    from transformers import Qwen2Config

    Qwen2Config(**QWEN_32B).save_pretrained(roots.model_roots[0] / "qwen-32b")
    job = merged(LONG, data={"seq_len": tokens})

    def peak(**model: Any) -> int:
        return estimate_memory(spec_from(merged(job, model=model), roots)).peak_device_bytes

    whole, tiled, auto = peak(tiled_mlp=False), peak(tiled_mlp=True), peak()
    assert tiled <= whole  # equal at 4096 tokens: the whole logits, which fit, are the peak there, not the MLP
    assert auto == (whole if whole <= 24 * 2**30 else tiled)
    assert (tokens == 4096) == (whole <= 24 * 2**30)


def test_auto_builds_the_model_the_fit_check_decided(tmp_path: Path, roots: PathRoots) -> None:
    from jobs.fit.estimate import with_mlp_tiling_decided
    from jobs.train.session import close_session, open_session

    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    job = merged(TINY_HF, model={"tiled_mlp_tokens": TILE}, training={"gradient_checkpointing": True},
                 checkpoint={"save_final": False})  # fmt: skip
    whole = estimate_memory(spec_from(merged(TINY_HF, model={"tiled_mlp": False}), roots)).peak_device_bytes
    for limit, tiles in ((None, False), (whole - 1, True)):
        spec = spec_from(merged(job, offload={"gpu_memory_limit": limit}), roots)
        assert with_mlp_tiling_decided(spec).model.tiled_mlp is tiles  # type: ignore[union-attr]
        session = open_session(spec, tmp_path / str(limit), resume=False)
        try:
            tiled = [m for m in session.model.modules() if hasattr(m, "ferry_tiled_mlp")]
            assert bool(tiled) is tiles
        finally:
            close_session(session)


def test_tile_size_without_tiling_is_refused(roots: PathRoots) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    with pytest.raises(JobSpecError) as refused:
        spec_from(merged(TINY_HF, model={"tiled_mlp": False, "tiled_mlp_tokens": 16}), roots)
    assert [(p.path, p.message) for p in refused.value.problems] == [
        ("model.tiled_mlp_tokens", "sizes the MLP's tiles; set model.tiled_mlp: true or auto, or remove it")
    ]
    with pytest.raises(JobSpecError, match="model.tiled_mlp_tokens"):
        spec_from(merged(TINY_HF, model={"tiled_mlp_tokens": 0}), roots)


def test_a_tiled_job_trains_as_an_untiled_one_with_offloaded_activations(tmp_path: Path, roots: PathRoots) -> None:
    from jobs import run_job
    from jobs.events import StepEvent

    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    offload = {"enable_model_cpu_offload": True, "granularity": "block", "activations": True}
    lora = {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"], "rank": 4}
    losses = {}
    for tiled in (False, True):
        data = merged(TINY_HF, model={"tiled_mlp": tiled, **({"tiled_mlp_tokens": TILE} if tiled else {})},
                      lora=lora, offload=offload, checkpoint={"save_final": False})  # fmt: skip
        events: list[Any] = []
        run_job(spec_from(data, roots), output_dir=tmp_path / str(tiled), report=events.append)
        losses[tiled] = [e.loss for e in events if isinstance(e, StepEvent)]
    assert len(losses[False]) == 4 and losses[True] == losses[False]
