"""Preference tuning (training.objective dpo | orpo) on a tiny Llama: TRL as the oracle, the reference pass
riding the policy's forward (no extra weight copies), offload equivalence, resume, learning."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from jobs import PathRoots, load_job_spec, run_job
from jobs.data.formats.preference import PreferenceBatches, collate_pairs, preference_pair
from jobs.data.tokenizers import HFTokenizer
from jobs.errors import JobSpecError
from jobs.events import event_to_wire
from jobs.models.transformer_lm import lm_loss
from jobs.objectives.preference import METRICS, PreferenceLoss, completion_logps, dpo_losses, forward_logits
from jobs.spec.llm import DPOSpec, ORPOSpec
from tests.jobs.llm_helpers import llm_spec, save_bpe_tokenizer, save_llama, write_jsonl

FACTS = [  # (question, right, wrong): a small real-facts preference set
    ("the capital of france", "paris", "berlin"),
    ("the capital of italy", "rome", "madrid"),
    ("the capital of japan", "tokyo", "beijing"),
    ("the largest planet", "jupiter", "mars"),
    ("water freezes at", "zero degrees", "fifty degrees"),
    ("the closest star", "the sun", "the moon"),
    ("a week has", "seven days", "nine days"),
    ("the chemical symbol of gold", "au", "ag"),
]


def pair_record(index: int) -> dict[str, Any]:
    question, right, wrong = FACTS[index % len(FACTS)]
    if index % 2:  # OpenAI's fine-tuning DPO layout
        return {
            "input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": right}],
            "non_preferred_output": [{"role": "assistant", "content": wrong}],
        }
    return {"prompt": [{"role": "user", "content": question}], "chosen": right, "rejected": wrong}  # TRL's


def preference_files(root: Path) -> Path:
    """A tiny Llama (``models/llama``), its tokenizer (``models/tok``) and 16 facts pairs (``data/pairs.jsonl``)."""
    save_bpe_tokenizer(root / "models" / "tok")
    save_llama(root / "models" / "llama")
    write_jsonl(root / "data" / "pairs.jsonl", [pair_record(i) for i in range(16)])
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preference_files(tmp_path_factory.mktemp("pref"))


def roots(root: Path) -> PathRoots:
    return PathRoots(model_roots=[root / "models"], data_roots=[root / "data"])


def pref_spec(objective: str = "dpo", **sections: Any) -> dict[str, Any]:
    spec = llm_spec(
        data={"path": "pairs.jsonl", "format": "preference"},
        training={"objective": objective, "steps": 4, "batch_size": 4, "learning_rate": 1e-2},
    )
    return llm_spec(
        **{**spec, **{k: v if v is None or k not in spec else {**spec[k], **v} for k, v in sections.items()}}
    )


def run(data: dict[str, Any], root: Path, output: Path, **kwargs: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    run_job(
        load_job_spec(yaml.safe_dump(data), roots(root)),
        output_dir=output,
        report=lambda e: events.append(event_to_wire(e)),
        **kwargs,
    )
    return events


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "step"]


def tiny_batch(root: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    tokenizer = HFTokenizer(root / "models" / "tok")
    pairs = [preference_pair(pair_record(i), tokenizer) for i in range(4)]
    return tokenizer, collate_pairs(pairs, tokenizer.pad_id)


def lora_model(root: Path, *, zero_b: bool) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "models" / "llama", dtype=torch.float32)
    model.config.use_cache = False
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=zero_b)
    return model, get_peft_model(model, config)


def trainable_grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_dpo_loss_rewards_and_gradients_equal_trls(tiny: Path) -> None:
    from accelerate import Accelerator
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    _, batch = tiny_batch(tiny)
    base, model = lora_model(tiny, zero_b=False)  # random B: the policy differs from the reference
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    training = SimpleNamespace(objective="dpo", dpo=DPOSpec(beta=0.1), orpo=ORPOSpec())
    ours = PreferenceLoss(training, model)
    loss = ours(model, batch)
    loss.backward()
    metrics, grads = ours.take_metrics(), trainable_grads(model)
    ours.remove()
    model.zero_grad()

    trainer = trl_dpo_trainer(model, None, Accelerator(cpu=True))
    inputs = trl_dpo_inputs(batch)
    reference = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5) and reference.item() != pytest.approx(math.log(2))
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name, value in metrics.items():
        assert value == pytest.approx(logged[name.replace("_", "/", 1)], abs=1e-5), name
    for name, grad in trainable_grads(model).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4)


def trl_dpo_trainer(model: nn.Module, ref_model: nn.Module | None, accelerator: Any) -> SimpleNamespace:
    """The attributes TRL's ``DPOTrainer`` methods read, set as ``DPOConfig(beta=0.1)`` would (sigmoid loss);
    with a ``ref_model``, as ``precompute_ref_log_probs=True`` would."""
    return SimpleNamespace(
        model=model,
        ref_model=ref_model,
        accelerator=accelerator,
        beta=0.1,
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        precompute_ref_logps=ref_model is not None,
        aux_loss_enabled=False,
        use_weighting=False,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def trl_dpo_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Ferry preference batch as ``DPOTrainer`` takes it: the completion tokens are the labelled ones."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "completion_mask": (batch["labels"] != -100).long(),
    }


def test_orpo_loss_equals_trls_odds_ratio_loss(tiny: Path) -> None:
    from trl.experimental.orpo import ORPOTrainer

    _, batch = tiny_batch(tiny)
    _, model = lora_model(tiny, zero_b=False)
    ours = PreferenceLoss(SimpleNamespace(objective="orpo", dpo=DPOSpec(), orpo=ORPOSpec(beta=0.25)), model)
    loss = ours(model, batch)
    metrics = ours.take_metrics()

    with torch.no_grad():  # TRL's own log-prob averaging and odds-ratio loss on the same logits
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        means = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
        trainer = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device=torch.device("cpu")))
        losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(trainer, means[:4], means[4:])
        labels = batch["labels"][:4, 1:]
        nll = torch.nn.functional.cross_entropy(logits[:4, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    # TRL's NLL term runs over prompt and completion; Ferry's, as the ORPO paper's, over the completion only.
    assert loss.item() == pytest.approx((nll - losses.mean()).item(), abs=1e-5)
    assert metrics["rewards_chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-5)
    assert metrics["rewards_rejected"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-5)


def test_the_reference_rows_are_the_base_with_adapters_disabled(tiny: Path) -> None:
    _, batch = tiny_batch(tiny)
    _, model = lora_model(tiny, zero_b=False)
    ours = PreferenceLoss(SimpleNamespace(objective="dpo", dpo=DPOSpec(beta=1.0), orpo=ORPOSpec()), model)
    ours(model, batch)
    rewards = ours.take_metrics()
    from jobs.objectives.preference import completion_logps

    with torch.no_grad():
        policy, _ = completion_logps(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
        )
        with model.disable_adapter():
            base, _ = completion_logps(
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
            )
    assert rewards["rewards_chosen"] == pytest.approx((policy[:4] - base[:4]).mean().item(), abs=1e-6)
    assert rewards["rewards_rejected"] == pytest.approx((policy[4:] - base[4:]).mean().item(), abs=1e-6)


@pytest.mark.parametrize("offload", [False, True])
def test_zero_initialised_adapters_give_ln2_first(tiny: Path, tmp_path: Path, offload: bool) -> None:
    data = pref_spec(training={"steps": 1}, offload={"enable_model_cpu_offload": offload})
    first = steps_of(run(data, tiny, tmp_path / "out"))[0]
    assert first["loss"] == torch.tensor(math.log(2)).item()  # policy == reference, bit for bit
    assert first["preference"]["rewards_margins"] == 0.0


@pytest.mark.parametrize("checkpointed", [False, True])
def test_offloaded_dpo_equals_resident_dpo_bitwise(tiny: Path, tmp_path: Path, checkpointed: bool) -> None:
    # Checkpointed: the layers keep the policy rows alone, and the engine's block units and offloaded
    # activations bring back those rows' inputs.
    streamed = {"granularity": "block", "activations": True} if checkpointed else {}

    def job(offload: bool) -> tuple[list[Any], list[Any]]:
        data = pref_spec(training={"gradient_checkpointing": checkpointed},
                         offload={"enable_model_cpu_offload": offload, **(streamed if offload else {})})  # fmt: skip
        events = run(data, tiny, tmp_path / str(offload))
        digests = [e["files"] for e in events if e["type"] == "checkpoint"]
        return [(s["loss"], s["preference"]) for s in steps_of(events)], digests

    resident, offloaded = job(False), job(True)
    assert resident == offloaded
    assert len({s[0] for s in resident[0]}) > 1  # it trained


def test_a_lora_dpo_step_copies_the_bytes_of_an_sft_step(tiny: Path) -> None:
    """The reference rows ride the policy's unit visits: a DPO step on a batch copies what an SFT step on the
    same (chosen + rejected) batch copies, where a separate reference forward would copy the weights again."""
    from accelerate import Accelerator

    from jobs.train.runner import train_step
    from offload import OffloadOptions, OffloadTrainingManager

    _, batch = tiny_batch(tiny)
    _, model = lora_model(tiny, zero_b=True)
    # Every visit copies (no ring-slot reuse), so the counters count unit visits.
    manager = OffloadTrainingManager(model, torch.device("cpu"), options=OffloadOptions(reuse_ring_slots=False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    dpo = PreferenceLoss(SimpleNamespace(objective="dpo", dpo=DPOSpec(), orpo=ORPOSpec()), model)
    copied = []
    for loss_fn in (lm_loss, lm_loss, dpo, lm_loss):
        train_step(
            model, loss_fn, [batch], optimizer=optimizer, scheduler=scheduler, accelerator=Accelerator(cpu=True),
            manager=manager, max_grad_norm=None, device=torch.device("cpu"),
        )  # fmt: skip
        copied.append(manager.stats().last_step_h2d_bytes)
    before = manager.stats().h2d_bytes
    with torch.no_grad(), model.disable_adapter():  # what a separate reference forward would add
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    separate = manager.stats().h2d_bytes - before
    manager.remove()
    assert copied[2] == copied[1] == copied[3] > 0, copied
    assert separate > 0.4 * copied[1]  # about one of the step's two passes over the weights
    print(f"bytes host->device per step: sft {copied[1]}, dpo {copied[2]}; a separate reference forward: {separate}")


def _dpo_step_rows(model: nn.Module, batch: dict[str, torch.Tensor], *, trim: bool) -> tuple[Any, list[int]]:
    """One LoRA DPO step with checkpointed layers: (loss, adapter gradients), and the rows each decoder layer ran
    with autograd on in the backward (the recompute). ``trim=False``: every row kept, as before."""
    import contextlib

    from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
    from jobs.recompute import apply_activation_checkpointing

    enable_hf_gradient_checkpointing(model.base_model.model)
    apply_activation_checkpointing(model.base_model.model)
    model.train()
    recomputed: list[int] = []
    layers = model.base_model.model.model.layers
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs: (
                recomputed.append(kwargs.get("hidden_states", args and args[0]).shape[0])
                if torch.is_grad_enabled()
                else None
            ),
            with_kwargs=True,
        )
        for layer in layers
    ]
    loss_fn = PreferenceLoss(SimpleNamespace(objective="dpo", dpo=DPOSpec(beta=0.5), orpo=ORPOSpec()), model)
    keep_all = contextlib.nullcontext if not trim else None
    with pytest.MonkeyPatch.context() as patch:
        if keep_all is not None:
            patch.setattr("jobs.objectives.preference.only_first_rows_need_gradient", lambda rows: keep_all())
        loss = loss_fn(model, batch)
        recomputed.clear()  # the forward's calls: every row
        loss.backward()
    for hook in hooks:
        hook.remove()
    return (loss.item(), trainable_grads(model)), recomputed


def test_the_reference_rows_leave_the_recompute_and_the_backward(tiny: Path) -> None:
    """The reference rows' log-probs are detached: checkpointed layers keep and recompute the policy rows alone,
    so the reference costs one forward of its rows. The loss is the same and the gradients equal to float
    rounding (the matmuls run over half the rows)."""
    _, batch = tiny_batch(tiny)  # 4 pairs: 8 policy rows, 8 reference rows
    (trimmed, rows), (whole, rows_before) = (_dpo_step_rows(lora_model(tiny, zero_b=False)[1], batch, trim=t)
                                             for t in (True, False))  # fmt: skip
    assert rows_before == [16, 16] and rows == [8, 8]  # two layers, each recomputed once
    assert trimmed[0] == whole[0]
    assert trimmed[1].keys() == whole[1].keys() and len(whole[1]) == 2 * 2 * 2
    for name, grad in whole[1].items():
        torch.testing.assert_close(trimmed[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(grad.abs().sum() > 0 for grad in whole[1].values())


def test_the_reference_rows_are_masked_rank_wide_and_a_recompute_of_policy_rows_not_at_all(tiny: Path) -> None:
    """The adapters' reference rows are zeroed on lora_A's output (rank 4 wide here, not q_proj's 64), and the
    recompute, which runs the policy rows alone, multiplies nothing."""
    _, batch = tiny_batch(tiny)
    model = lora_model(tiny, zero_b=False)[1]
    multiplied: list[tuple[int, int]] = []  # (rows, width) of each masked output
    original = PreferenceLoss.mask_rows

    def recording(self: PreferenceLoss, output: torch.Tensor) -> torch.Tensor | None:
        masked = original(self, output)
        if masked is not None:
            multiplied.append((output.shape[0], output.shape[-1]))
        return masked

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PreferenceLoss, "mask_rows", recording)
        (loss, grads), recomputed = _dpo_step_rows(model, batch, trim=True)
    assert recomputed == [8, 8]
    # Two layers with q_proj and v_proj adapted: four masked outputs, all in the forward over the 16 rows.
    assert multiplied == [(16, 4)] * 4
    assert math.isfinite(loss) and all(grad.abs().sum() > 0 for grad in grads.values())


def test_offloaded_activations_hold_the_policy_rows_alone(tiny: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """Under ``offload.activations`` the checkpointed inputs go to pinned host memory: half the bytes once the
    reference rows are not kept."""
    import contextlib

    data = pref_spec(training={"gradient_checkpointing": True, "steps": 2},
                     offload={"enable_model_cpu_offload": True, "granularity": "block", "activations": True})  # fmt: skip

    def offloaded(output: str) -> int:
        return steps_of(run(data, tiny, tmp_path / output))[-1]["offload"]["activation_offloaded_bytes"]

    trimmed = offloaded("trimmed")
    monkeypatch.setattr(
        "jobs.objectives.preference.only_first_rows_need_gradient", lambda rows: contextlib.nullcontext()
    )
    assert trimmed > 0 and 2 * trimmed == offloaded("every-row")


def test_a_layer_that_draws_random_numbers_keeps_every_row(tiny: Path) -> None:
    """With dropout in the adapters the recompute must draw the forward's numbers, which a recompute of fewer
    rows would not: such a layer keeps every row, and the step is the one before trimming, bit for bit."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, batch = tiny_batch(tiny)

    def model() -> nn.Module:
        base = AutoModelForCausalLM.from_pretrained(tiny / "models" / "llama", dtype=torch.float32)
        base.config.use_cache = False
        torch.manual_seed(1)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.2, init_lora_weights=False)
        return get_peft_model(base, lora)

    results = []
    for trim in (True, False):
        torch.manual_seed(7)
        results.append(_dpo_step_rows(model(), batch, trim=trim))
    (trimmed, rows), (whole, _) = results
    assert rows == [16, 16]
    assert trimmed[0] == whole[0]
    assert all(torch.equal(trimmed[1][name], grad) for name, grad in whole[1].items())


@pytest.mark.parametrize("function", ["forward", "__call__"])
def test_a_checkpointed_layer_trims_the_rows_in_either_transformers_form(function: str) -> None:
    """transformers after 5.17 checkpoints ``partial(forward, layer, **kwargs)``; 5.17 and before
    ``partial(layer.__call__, **kwargs)``. Either way the per-row keyword tensors (mask, positions, rotary
    tables) are cut with the hidden states, and the inputs' and weights' gradients are those of the policy rows."""
    import functools

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from jobs.recompute import checkpoint_layer, only_first_rows_need_gradient

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0)
    rows, positions = 3, 6
    hidden = torch.randn(2 * rows, positions, 32)
    position_ids = torch.arange(positions).expand(2 * rows, -1) + torch.arange(2 * rows)[:, None]  # per row
    mask = torch.ones(2 * rows, 1, positions, positions, dtype=torch.bool).tril()
    mask[rows - 1, ..., 0] = False  # a row of its own
    mask = torch.cat([mask[:rows], mask[:rows]])  # the reference rows repeat the policy's, as DPO's do
    kwargs = {"attention_mask": mask, "position_embeddings": LlamaRotaryEmbedding(config)(hidden, position_ids)}

    def grads(checkpointed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        layer.zero_grad()
        x = hidden.clone().requires_grad_()
        if not checkpointed:
            out = layer(x, **kwargs)
        else:
            layer.gradient_checkpointing = function == "forward"
            call = (functools.partial(type(layer).forward, layer, **kwargs) if function == "forward"
                    else functools.partial(layer.__call__, **kwargs))  # fmt: skip
            with only_first_rows_need_gradient(rows):
                out = checkpoint_layer(call, x)
            layer.gradient_checkpointing = False
        out[:rows].pow(2).sum().backward()  # the loss reads the first rows alone
        return x.grad, [p.grad.clone() for p in layer.parameters()]

    (x_plain, w_plain), (x_trim, w_trim) = grads(False), grads(True)
    assert torch.equal(x_trim[rows:], torch.zeros_like(x_trim[rows:]))
    torch.testing.assert_close(x_trim, x_plain, rtol=1e-5, atol=1e-7)
    for plain, trimmed in zip(w_plain, w_trim, strict=True):
        torch.testing.assert_close(trimmed, plain, rtol=1e-5, atol=1e-6)


def test_resumed_dpo_continues_bitwise(tiny: Path, tmp_path: Path) -> None:
    data = pref_spec(training={"steps": 4})
    straight = steps_of(run(data, tiny, tmp_path / "straight"))
    polls = iter([None, None, "pause"])
    run(data, tiny, tmp_path / "paused", should_stop=lambda: next(polls, None))
    resumed = steps_of(run(data, tiny, tmp_path / "paused"))
    assert [(s["step"], s["loss"], s["preference"]) for s in resumed] == [
        (s["step"], s["loss"], s["preference"]) for s in straight[2:]
    ]


def test_dpo_learns_the_facts(tiny: Path, tmp_path: Path) -> None:
    data = pref_spec(training={"steps": 12}, lora={"rank": 8, "alpha": 16})
    steps = steps_of(run(data, tiny, tmp_path / "out"))
    accuracies = [s["preference"]["rewards_accuracies"] for s in steps]
    assert steps[0]["preference"]["rewards_accuracies"] == 0.0  # policy == reference: no pair wins yet
    assert min(accuracies[-3:]) > 0.9 and steps[-1]["loss"] < steps[0]["loss"]


def test_orpo_trains_a_full_fine_tune(tiny: Path, tmp_path: Path) -> None:
    steps = steps_of(
        run(pref_spec("orpo", lora=None, training={"steps": 3, "learning_rate": 1e-3}), tiny, tmp_path / "o")
    )
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) and s["preference"] for s in steps)


@pytest.mark.parametrize(
    ("changes", "field", "text"),
    [
        ({"lora": None, "model": {"quantize": "nf4"}}, "model.quantize", "(QLoRA); add a lora section"),
        ({"data": {"format": "chat"}}, "training.objective", "dpo trains on preference pairs"),
        ({"training": {"objective": "sft"}}, "data.format", "train with training.objective: dpo or orpo"),
    ],
)
def test_submit_refuses_what_preference_tuning_cannot_do(
    tiny: Path, changes: dict[str, Any], field: str, text: str
) -> None:
    data = pref_spec(**changes)
    with pytest.raises(JobSpecError) as raised:
        load_job_spec(yaml.safe_dump(data), roots(tiny))
    assert any(p.path == field and text in p.message for p in raised.value.problems), raised.value.problems


def test_preflight_names_the_row_and_field_of_a_bad_pair(tiny: Path, tmp_path: Path) -> None:
    from jobs.spec.preflight import preflight_problems

    write_jsonl(tiny / "data" / "bad.jsonl", [pair_record(0), {"prompt": "q", "chosen": "a"}])
    spec = load_job_spec(yaml.safe_dump(pref_spec(data={"path": "bad.jsonl", "format": "preference"})), roots(tiny))
    [problem] = preflight_problems(spec)
    assert problem.path == "data.path" and "bad.jsonl row 2: field 'rejected': is missing" in problem.message


def test_the_fit_estimate_counts_the_rows_a_preference_step_runs(tiny: Path) -> None:
    """A pair is two rows and LoRA DPO adds a reference row for each: the estimate counted batch_size rows, so
    a DPO job that would not fit passed the fit check and ran out of device memory at its first step."""
    from jobs.models.decoder_activations import DecoderDims, decoder_activation_bytes, decoder_checkpointed_inputs

    dims = DecoderDims(64, 128, 2, 300, (10, 4))
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in FACTS]
    write_jsonl(tiny / "data" / "chat.jsonl", chat)

    def activations(data: dict[str, Any]) -> tuple[int, list[int]]:
        spec = load_job_spec(yaml.safe_dump(data), roots(tiny))
        return decoder_activation_bytes(spec, dims), decoder_checkpointed_inputs(spec, dims)

    sixteen_rows = activations(llm_spec(training={"batch_size": 16}))
    assert activations(pref_spec("dpo")) == sixteen_rows  # 4 pairs, chosen and rejected, policy and reference
    assert activations(pref_spec("orpo", training={"batch_size": 8})) == sixteen_rows  # no reference rows
    assert activations(pref_spec("dpo", lora=None, training={"batch_size": 8})) == sixteen_rows  # cached reference
    assert activations(llm_spec(training={"batch_size": 4}))[0] < sixteen_rows[0]


def test_the_fit_estimate_keeps_the_policy_rows_of_a_checkpointed_lora_dpo_step(tiny: Path) -> None:
    """Checkpointed LoRA DPO keeps and recomputes the policy rows alone (its reference rows need no gradient), so
    the checkpointed inputs (the host arena of offload.activations) are those of half the rows; not where the
    layers draw random numbers (dropout in the adapters or the model), which keep every row."""
    from dataclasses import replace

    from jobs.models.decoder_activations import DecoderDims, decoder_checkpointed_inputs
    from jobs.models.hf_causal_lm import hf_checkpointed_inputs, meta_hf_causal_lm

    no_dropout = DecoderDims(64, 128, 2, 300, (10, 4), draws_random_numbers=False)
    checkpointed = {"training": {"gradient_checkpointing": True}}

    def kept(data: dict[str, Any], dims: DecoderDims = no_dropout) -> list[int]:
        return decoder_checkpointed_inputs(load_job_spec(yaml.safe_dump(data), roots(tiny)), dims)

    sft_8_rows = kept(llm_spec(training={"batch_size": 8, "gradient_checkpointing": True}))
    sft_16_rows = kept(llm_spec(training={"batch_size": 16, "gradient_checkpointing": True}))
    assert kept(pref_spec("dpo", **checkpointed)) == sft_8_rows  # 4 pairs: 8 policy rows, 8 reference rows
    assert kept(pref_spec("dpo", lora={"dropout": 0.1}, **checkpointed)) == sft_16_rows
    assert kept(pref_spec("dpo", **checkpointed), replace(no_dropout, draws_random_numbers=True)) == sft_16_rows
    # The tiny Llama's config has no dropout; a config that sets one draws random numbers.
    spec = load_job_spec(yaml.safe_dump(pref_spec("dpo", **checkpointed)), roots(tiny))
    model = meta_hf_causal_lm(spec.model)  # type: ignore[arg-type]
    without = sum(hf_checkpointed_inputs(spec, model))
    model.config.attention_dropout = 0.1
    assert sum(hf_checkpointed_inputs(spec, model)) == 2 * without > 0


def evals_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "eval"]


def test_submit_accepts_eval_with_a_preference_objective(tiny: Path) -> None:
    for objective in ("dpo", "orpo"):
        spec = load_job_spec(yaml.safe_dump(pref_spec(objective, eval={"split": 0.25})), roots(tiny))
        assert spec.eval is not None and spec.training.objective == objective


def test_a_lora_dpo_job_evaluates_its_pairs_into_events_and_tensorboard(tiny: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = pref_spec(eval={"split": 0.25, "every_steps": 2}, lora={"rank": 8, "alpha": 16})
    evals = evals_of(run(data, tiny, tmp_path / "out"))
    assert [e["step"] for e in evals] == [0, 2, 4]  # step 0: the base model, before any training
    assert all(e["perplexity"] is None and set(e["preference"]) == set(METRICS) for e in evals)
    assert all(e["metrics"]["pairs"] == 4.0 and e["metrics"]["tokens"] > 0 for e in evals)  # 16 pairs, 1/4 held out
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2)) and evals[0]["preference"]["rewards_margins"] == 0.0
    assert evals[-1]["preference"]["rewards_margins"] != 0.0  # the adapters have moved the policy off the base
    accumulator = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    accumulator.Reload()
    tags = {"eval/loss", "eval/rewards/chosen", "eval/rewards/accuracies", "eval/logps/rejected"}
    assert tags <= set(accumulator.Tags()["scalars"]) and "eval/perplexity" not in accumulator.Tags()["scalars"]
    margins = [(e.step, e.value) for e in accumulator.Scalars("eval/rewards/margins")]
    assert margins == [(e["step"], pytest.approx(e["preference"]["rewards_margins"])) for e in evals]


def test_evaluation_leaves_the_training_steps_metrics_alone(tiny: Path, tmp_path: Path) -> None:
    write_jsonl(tiny / "data" / "held.jsonl", [pair_record(i) for i in range(3, 9)])
    plain = pref_spec()
    evaluated = pref_spec(eval={"path": "held.jsonl", "every_steps": 1})
    without = run(plain, tiny, tmp_path / "without")
    with_eval = run(evaluated, tiny, tmp_path / "with")
    assert [e["step"] for e in evals_of(with_eval)] == [0, 1, 2, 3, 4]
    assert [(s["loss"], s["preference"]) for s in steps_of(with_eval)] == [
        (s["loss"], s["preference"]) for s in steps_of(without)
    ]


def test_evaluate_pairs_equals_dpo_by_hand_and_restores_the_step_state(tiny: Path) -> None:
    """The eval loss and rewards of the pairs, with the model in eval mode and without gradient; the training
    step's sums, micro-batch count and reference-row mask in the loss are as they were before."""
    from accelerate import Accelerator

    from jobs.evaluate.pairs import evaluate_pairs

    tokenizer, train_batch = tiny_batch(tiny)
    _, model = lora_model(tiny, zero_b=False)
    dpo = PreferenceLoss(SimpleNamespace(objective="dpo", dpo=DPOSpec(beta=0.5), orpo=ORPOSpec()), model)
    dpo(model, train_batch)  # a training micro-batch whose metrics the step has not taken yet
    sums, batches, mask = dict(dpo._sums), dpo._batches, dpo._mask
    source = PreferenceBatches([preference_pair(pair_record(i), tokenizer) for i in range(4, 10)], 3, 0, 0)
    source.pad_id = tokenizer.pad_id
    result = evaluate_pairs(
        model, dpo, source, max_batches=None, device=torch.device("cpu"), accelerator=Accelerator(cpu=True)
    )
    assert model.training and dpo._mask is mask and dpo._batches == batches == 1
    assert dpo._sums.keys() == sums.keys() and all(torch.equal(dpo._sums[k], sums[k]) for k in sums)
    dpo.remove()

    model.eval()
    by_hand: dict[str, list[torch.Tensor]] = defaultdict(list)
    with torch.no_grad():
        for index in range(2):
            batch = source.in_order(index)
            policy, counts = completion_logps(forward_logits(model, batch), batch["labels"])
            with model.disable_adapter():
                reference, _ = completion_logps(forward_logits(model, batch), batch["labels"])
            chosen, rejected, ref_chosen, ref_rejected = policy[:3], policy[3:], reference[:3], reference[3:]
            losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, (counts[:3], counts[3:]), dpo.dpo)
            rewards = (0.5 * (chosen - ref_chosen), 0.5 * (rejected - ref_rejected))
            by_hand["loss"].append(losses)
            by_hand["rewards_chosen"].append(rewards[0])
            by_hand["rewards_rejected"].append(rewards[1])
            by_hand["rewards_accuracies"].append((rewards[0] > rewards[1]).float())
            by_hand["rewards_margins"].append(rewards[0] - rewards[1])
            by_hand["logps_chosen"].append(chosen)
            by_hand["logps_rejected"].append(rejected)
    expected = {name: torch.cat(values).mean().item() for name, values in by_hand.items()}
    assert result.pairs == 6 and result.batches == 2 and result.perplexity is None
    assert result.loss == pytest.approx(expected.pop("loss"), abs=1e-6)
    assert result.preference == pytest.approx(expected, abs=1e-5)
    assert expected["rewards_margins"] != 0.0  # non-zero adapters: the policy is not the reference


def test_orpo_evaluates_its_pairs(tiny: Path, tmp_path: Path) -> None:
    evals = evals_of(run(pref_spec("orpo", eval={"split": 0.25, "every_steps": 2}), tiny, tmp_path / "out"))
    assert [e["step"] for e in evals] == [0, 2, 4]
    for event in evals:
        figures = event["preference"]
        assert event["perplexity"] is None and math.isfinite(event["eval_loss"]) and event["eval_loss"] > 0
        assert figures["rewards_margins"] == pytest.approx(
            figures["rewards_chosen"] - figures["rewards_rejected"], abs=1e-6
        )
        assert figures["logps_chosen"] < 0 and figures["logps_rejected"] < 0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns the held-out facts' shape
