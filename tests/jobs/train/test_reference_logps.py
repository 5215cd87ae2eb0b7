"""DPO on a full fine-tune: the initial model's reference log-probs, computed in one pass before training and
cached; TRL's precomputed-reference DPO as the oracle, the cache's reuse and invalidation, offload, resume."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file

from jobs import load_job_spec
from jobs.data.formats.preference import PreferenceBatches, preference_pair
from jobs.data.tokenizers import HFTokenizer
from jobs.distributed.batches import RankShard
from jobs.objectives.preference import PreferenceLoss
from jobs.spec.llm import DPOSpec, ORPOSpec
from jobs.train import reference_logps
from jobs.train.reference_logps import reference_pass
from tests.jobs.helpers import assert_same_weights, final_weights
from tests.jobs.llm_helpers import write_jsonl
from tests.jobs.objectives.test_preference import (
    pair_record,
    pref_spec,
    preference_files,
    roots,
    run,
    steps_of,
    trainable_grads,
    trl_dpo_inputs,
    trl_dpo_trainer,
)

LN2 = torch.tensor(math.log(2)).item()  # ln 2 in float32, as the loss is computed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_preference.py's tiny Llama, tokenizer and 16 facts pairs."""
    return preference_files(tmp_path_factory.mktemp("full-dpo"))


def test_submit_accepts_dpo_on_a_full_fine_tune(tiny: Path) -> None:
    spec = load_job_spec(yaml.safe_dump(full_dpo()), roots(tiny))
    assert spec.lora is None and spec.training.objective == "dpo"


def full_dpo(**sections: Any) -> dict[str, Any]:
    """The DPO job of test_preference.py without its lora section: a full fine-tune."""
    training = {"steps": 3, "learning_rate": 1e-3, **sections.pop("training", {})}
    return pref_spec(lora=None, training=training, **sections)


def logs(events: list[dict[str, Any]]) -> list[str]:
    return [e["message"] for e in events if e["type"] == "log" and e["message"].startswith("reference log-probs")]


def cache_files(output: Path) -> list[Path]:
    return sorted((output / "cache").iterdir())


def hf_llama(root: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "models" / "llama", dtype=torch.float32)
    model.config.use_cache = False
    return model


def test_full_dpo_loss_rewards_and_gradients_equal_trls_with_precomputed_reference(tiny: Path) -> None:
    """Ferry's pass over the data (batches of 3 pairs in stored order) and its loss on a shuffled batch that
    carries the cached values, against TRL's ``compute_ref_log_probs`` and its loss with
    ``precompute_ref_log_probs`` on the same batch."""
    from accelerate import Accelerator
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = HFTokenizer(tiny / "models" / "tok")
    pairs = [preference_pair(pair_record(i), tokenizer) for i in range(8)]
    reference, policy = hf_llama(tiny), hf_llama(tiny).train()
    with torch.no_grad():  # the policy after some training: it differs from the reference
        generator = torch.Generator().manual_seed(3)
        for param in policy.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    accelerator = Accelerator(cpu=True)
    table = reference_pass(
        reference, pairs, batch_size=3, pad_id=tokenizer.pad_id, accelerator=accelerator, device=torch.device("cpu")
    )
    source = PreferenceBatches(pairs, 4, seed=5, pad_id=tokenizer.pad_id)
    source.use_reference(table)
    batch = source.batch(1)  # shuffled: the values follow their pairs
    training = SimpleNamespace(objective="dpo", dpo=DPOSpec(beta=0.1), orpo=ORPOSpec())
    ours = PreferenceLoss(training, policy)
    assert ours.cached_reference  # no adapters: the reference comes with the batch
    loss = ours(policy, batch)
    loss.backward()
    metrics, grads = ours.take_metrics(), trainable_grads(policy)
    policy.zero_grad()

    for model in (reference, policy):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = trl_dpo_trainer(policy, reference, accelerator)
    inputs = trl_dpo_inputs(batch)
    ref_chosen, ref_rejected = DPOTrainer.compute_ref_log_probs(trainer, reference, inputs)
    torch.testing.assert_close(batch["reference_logps"], torch.cat([ref_chosen, ref_rejected]), atol=1e-5, rtol=0)
    expected = DPOTrainer._compute_loss(
        trainer, policy, {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}, False
    )
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5) and abs(expected.item() - math.log(2)) > 1e-3
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name, value in metrics.items():
        assert value == pytest.approx(logged[name.replace("_", "/", 1)], abs=1e-5), name
    for name, grad in trainable_grads(policy).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4)


def test_full_dpo_batches_carry_each_pairs_reference_through_shuffle_and_ranks(tiny: Path) -> None:
    tokenizer = HFTokenizer(tiny / "models" / "tok")
    pairs = [preference_pair(pair_record(i), tokenizer) for i in range(8)]
    source = PreferenceBatches(pairs, 4, seed=0, pad_id=tokenizer.pad_id)
    source.use_reference(torch.stack([torch.arange(8.0), -torch.arange(8.0) - 1], dim=1))  # row i: (i, -i - 1)
    for batch in (
        source.batch(0),
        source.batch(3),
        *(RankShard(source, rank=r, world_size=2).batch(2) for r in (0, 1)),
    ):
        rows = batch["input_ids"].shape[0] // 2
        ids = batch["reference_logps"][:rows].long().tolist()
        assert (batch["reference_logps"][rows:] == -batch["reference_logps"][:rows] - 1).all()  # same pair, rejected
        for row, index in enumerate(ids):  # each row is the pair its value belongs to
            chosen = pairs[index].example(pairs[index].chosen).input_ids
            assert batch["input_ids"][row, : len(chosen)].tolist() == chosen


def test_full_dpo_reference_pass_shares_add_up_to_the_whole(tiny: Path) -> None:
    """Data parallelism: rank r computes batches r, r + N, ... and the ranks' tables sum to one rank's table."""
    from accelerate import Accelerator

    tokenizer = HFTokenizer(tiny / "models" / "tok")
    pairs = [preference_pair(pair_record(i), tokenizer) for i in range(7)]
    model = hf_llama(tiny)
    options = dict(batch_size=2, pad_id=tokenizer.pad_id, accelerator=Accelerator(cpu=True), device=torch.device("cpu"))
    whole = reference_pass(model, pairs, **options)
    shares = [reference_pass(model, pairs, share=(rank, 2), **options) for rank in (0, 1)]
    assert torch.equal(shares[0] + shares[1], whole) and (whole < 0).all()
    assert (shares[0][2:4] == 0).all() and (shares[1][:2] == 0).all()  # batch 1 (pairs 2, 3) is rank 1's
    assert model.training  # left in training mode


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "model-and-optimizer-offload"])
def test_full_dpo_first_loss_is_ln2(tiny: Path, tmp_path: Path, offload: bool) -> None:
    both = {"enable_model_cpu_offload": offload, "enable_optimizer_cpu_offload": offload}
    events = run(full_dpo(training={"steps": 1}, offload=both), tiny, tmp_path / "out")
    first = steps_of(events)[0]
    assert first["loss"] == LN2  # policy == reference at step 0, bit for bit
    assert first["preference"]["rewards_margins"] == first["preference"]["rewards_chosen"] == 0.0
    computing, computed = logs(events)
    assert computing == "reference log-probs: computing 16 pairs with the initial model"
    assert computed.startswith("reference log-probs: 16 pairs computed in ")
    assert computed.endswith(f" s, cached at cache/{cache_files(tmp_path / 'out')[0].name}")


def test_full_dpo_with_model_and_optimizer_offload_equals_resident_bitwise(tiny: Path, tmp_path: Path) -> None:
    """The pass through the offload engine computes the resident pass's values; training then matches too."""

    def job(offload: bool) -> tuple[list[Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        both = {"enable_model_cpu_offload": offload, "enable_optimizer_cpu_offload": offload}
        out = tmp_path / str(offload)
        steps = [(s["loss"], s["preference"]) for s in steps_of(run(full_dpo(offload=both), tiny, out))]
        return steps, load_file(str(cache_files(out)[0])), final_weights(out)

    (resident, *tensors), (offloaded, *offloaded_tensors) = job(False), job(True)
    assert resident == offloaded and len({loss for loss, _ in resident}) > 1  # it trained
    for mine, theirs in zip(tensors, offloaded_tensors, strict=True):  # the cached tables, the final weights
        assert_same_weights(mine, theirs)


def test_full_dpo_reuses_the_cache_in_a_later_job(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later job on the same model, data and data settings (here with other steps, learning rate and beta)
    reads the file: no forward of the reference pass runs."""
    out = tmp_path / "out"
    first = run(full_dpo(), tiny, out)
    [file] = cache_files(out)
    written = file.stat().st_mtime_ns
    passes: list[int] = []
    counted = reference_logps.reference_pass
    monkeypatch.setattr(reference_logps, "reference_pass", lambda *a, **k: passes.append(1) or counted(*a, **k))
    other = full_dpo(training={"steps": 2, "learning_rate": 5e-4, "dpo": {"beta": 0.5}})
    later = run(other, tiny, out, resume=False)
    assert passes == [] and cache_files(out) == [file] and file.stat().st_mtime_ns == written
    assert logs(later) == [f"reference log-probs: reused cache/{file.name} (16 pairs; same model, data and settings)"]
    assert steps_of(later)[0]["loss"] == LN2 and steps_of(first)[0]["loss"] == LN2


def test_full_dpo_reuses_a_shared_cache_across_jobs(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service gives every job its own output directory and one cache directory for all: a second job with
    the same inputs, in another output directory, reads the first one's file."""
    shared = tmp_path / "cache"
    run(full_dpo(training={"steps": 1}), tiny, tmp_path / "job-1", cache_dir=shared)
    [file] = sorted(shared.iterdir())
    assert not (tmp_path / "job-1" / "cache").exists()
    passes: list[int] = []
    counted = reference_logps.reference_pass
    monkeypatch.setattr(reference_logps, "reference_pass", lambda *a, **k: passes.append(1) or counted(*a, **k))
    later = run(full_dpo(training={"steps": 1, "learning_rate": 5e-4}), tiny, tmp_path / "job-2", cache_dir=shared)
    assert passes == [] and sorted(shared.iterdir()) == [file]
    assert logs(later) == [f"reference log-probs: reused {file} (16 pairs; same model, data and settings)"]


def test_full_dpo_recomputes_when_the_data_changes(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "models").symlink_to(tiny / "models")  # the tiny model; the data of this test's own
    records = [pair_record(i) for i in range(16)]
    write_jsonl(tmp_path / "data" / "pairs.jsonl", records)
    out, data = tmp_path / "out", full_dpo(training={"steps": 1})
    run(data, tmp_path, out)
    [before] = cache_files(out)
    records[4] = {**records[4], "rejected": "the moon"}  # one pair's rejected completion
    write_jsonl(tmp_path / "data" / "pairs.jsonl", records)
    events = run(data, tmp_path, out, resume=False)
    assert logs(events)[0] == "reference log-probs: computing 16 pairs with the initial model"
    [after] = [f for f in cache_files(out) if f != before]
    old, new = load_file(str(before))["train"], load_file(str(after))["train"]
    changed = (old != new).any(dim=1).nonzero().flatten().tolist()
    assert changed == [4] and old[4, 0] == new[4, 0]  # only that pair's rejected value


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[: len(b) // 2], "is unreadable (SafetensorError: Error while deserializing header"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "is damaged (its tensors do not match their SHA-256)"),
    ],
    ids=["truncated", "bit-flipped"],
)
def test_full_dpo_recomputes_a_damaged_cache(tiny: Path, tmp_path: Path, damage: Any, why: str) -> None:
    out = tmp_path / "out"
    run(full_dpo(training={"steps": 1}), tiny, out)
    [file] = cache_files(out)
    good = file.read_bytes()
    file.write_bytes(damage(good))
    events = run(full_dpo(training={"steps": 1}), tiny, out, resume=False)
    warning, computing, _ = logs(events)
    assert warning.startswith(f"reference log-probs: cache/{file.name} {why}") and warning.endswith(
        "computing them again"
    )
    assert computing.startswith("reference log-probs: computing")
    assert cache_files(out) == [file]  # rewritten in place; no temporary file left
    assert_same_weights(load_file(str(file)), safetensors_load(good))
    assert steps_of(events)[0]["loss"] == LN2


def test_resumed_full_dpo_continues_bitwise_from_the_cache(tiny: Path, tmp_path: Path) -> None:
    data = full_dpo(training={"steps": 4})
    straight = steps_of(run(data, tiny, tmp_path / "straight"))
    polls = iter([None, None, "pause"])
    run(data, tiny, tmp_path / "paused", should_stop=lambda: next(polls, None))
    resumed = run(data, tiny, tmp_path / "paused")
    assert logs(resumed)[0].startswith("reference log-probs: reused")
    assert [(s["step"], s["loss"], s["preference"]) for s in steps_of(resumed)] == [
        (s["step"], s["loss"], s["preference"]) for s in straight[2:]
    ]


def test_resumed_full_dpo_without_its_cache_names_the_fix(tiny: Path, tmp_path: Path) -> None:
    """The resumed model holds trained weights: recomputing from them would be a wrong reference."""
    data = full_dpo(training={"steps": 4})
    polls = iter([None, None, "pause"])
    run(data, tiny, tmp_path, should_stop=lambda: next(polls, None))
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"is missing, and the model now holds checkpoint step 2's weights") as raised:
        run(data, tiny, tmp_path)
    assert "submit the job again into a new output directory" in str(raised.value)


def test_full_dpo_on_two_ranks_shares_the_pass_and_trains_what_one_rank_trains(tiny: Path, tmp_path: Path) -> None:
    """Two gloo ranks of 2 pairs each compute every other batch of the pass and sum their tables; rank 0 writes
    the one cache file; training matches one rank on the union batch (float summation order aside)."""
    two = run(full_dpo(training={"batch_size": 2}, distributed={"world_size": 2}), tiny, tmp_path / "two")
    one = run(full_dpo(training={"batch_size": 4}), tiny, tmp_path / "one")
    torch.testing.assert_close([s["loss"] for s in steps_of(two)], [s["loss"] for s in steps_of(one)])
    assert logs(two)[0] == "reference log-probs: computing 16 pairs with the initial model"
    [file], [union] = cache_files(tmp_path / "two"), cache_files(tmp_path / "one")
    assert file.name == union.name  # the same inputs: the batch size is not one of them
    torch.testing.assert_close(load_file(str(file)), load_file(str(union)), rtol=0, atol=1e-5)


def test_full_dpo_evaluates_with_the_eval_pairs_cached_reference(tiny: Path, tmp_path: Path) -> None:
    """The eval pairs' reference log-probs come from the pass before training: at step 0 the policy is the
    reference, so the eval loss is ln 2 and every reward 0; a later job reads them from the cache."""
    data = full_dpo(eval={"split": 0.25, "every_steps": 3})
    first = run(data, tiny, tmp_path / "first")
    evals = [e for e in first if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3]
    assert evals[0]["eval_loss"] == pytest.approx(LN2, abs=1e-6) and evals[0]["metrics"]["pairs"] == 4.0
    assert evals[0]["preference"]["rewards_chosen"] == pytest.approx(0.0, abs=1e-5)
    assert evals[0]["preference"]["rewards_margins"] == pytest.approx(0.0, abs=1e-5)
    assert evals[1]["preference"]["rewards_margins"] != pytest.approx(0.0, abs=1e-5)  # it trained
    shutil.copytree(tmp_path / "first" / "cache", tmp_path / "second" / "cache")
    second = run(data, tiny, tmp_path / "second")
    assert any(message.startswith("reference log-probs: reused") for message in logs(second))
    assert [e for e in second if e["type"] == "eval"] == evals
