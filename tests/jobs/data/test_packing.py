"""Packing that respects documents (position ids restart, no attention across them) and padded batches."""

from __future__ import annotations

from pathlib import Path

import torch

from jobs.data.formats.record import IGNORE, Example
from jobs.data.packing import concatenate, fit_examples, pack
from jobs.data.padded import PaddedBatches
from jobs.data.prepare import model_keeps_documents_apart
from jobs.models.transformer_lm import lm_loss
from tests.jobs.llm_helpers import save_llama


def examples(*lengths: int, prompt: int = 2) -> list[Example]:
    start, made = 10, []
    for n in lengths:
        ids = list(range(start, start + n))
        made.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
        start += n
    return made


def test_pack_restarts_positions_and_masks_each_documents_first_label() -> None:
    tensors, counts = pack(examples(3, 4, 5), seq_len=8, pad_id=0)
    assert tensors["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]]
    assert tensors["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15, 16, 0], [17, 18, 19, 20, 21, 0, 0, 0]]
    assert tensors["labels"].tolist() == [
        [IGNORE, IGNORE, 12, IGNORE, IGNORE, 15, 16, IGNORE],
        [IGNORE, IGNORE, 19, 20, 21, IGNORE, IGNORE, IGNORE],
    ]
    assert (counts.sequences, counts.padding_tokens, counts.truncated, counts.skipped) == (2, 4, 0, 0)


def test_truncated_and_skipped_examples_are_counted() -> None:
    long, prompt_only = examples(12)[0], Example([1, 2, 3], [IGNORE, IGNORE, IGNORE])
    cut_response = Example(list(range(10)), [IGNORE] * 9 + [9])  # its only trained token lies past seq_len
    kept, counts = fit_examples([long, prompt_only, cut_response], seq_len=8)
    assert [len(e.input_ids) for e in kept] == [8]
    assert (counts.truncated, counts.skipped, counts.examples) == (2, 2, 1)


def test_plain_text_runs_on_across_rows_and_keeps_its_tail() -> None:
    tensors, counts = concatenate(examples(5, 6, prompt=0), seq_len=4, pad_id=0, restart_positions=True)
    assert tensors["input_ids"].shape == (3, 4) and counts.padding_tokens == 1
    # Row 2 starts inside document 1 and counts from 0; document 2 restarts at its own first token.
    assert tensors["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 0]]
    assert tensors["labels"][1].tolist() == [14, IGNORE, 16, 17]


def test_packed_documents_do_not_attend_to_each_other(tmp_path: Path) -> None:
    """The packed row's logits equal each document's logits when it runs alone: no cross-document attention."""
    from transformers import AutoModelForCausalLM

    assert model_keeps_documents_apart()  # transformers >= 4.47 derives the block-diagonal mask
    model = AutoModelForCausalLM.from_pretrained(save_llama(tmp_path / "llama"), attn_implementation="sdpa").eval()
    model.config.use_cache = False  # as in training (jobs/models/hf_causal_lm.py): with a cache the path is off
    docs = examples(5, 7, 4)
    tensors, _ = pack(docs, seq_len=16, pad_id=0)
    with torch.no_grad():
        packed = model(input_ids=tensors["input_ids"], position_ids=tensors["position_ids"]).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc.input_ids])).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc.input_ids)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc.input_ids)
        # Without the restarting position ids the later documents see the earlier ones: the check has teeth.
        leaky = model(input_ids=tensors["input_ids"]).logits[0]
        assert not torch.allclose(leaky[5:12], packed[5:12], atol=1e-3)


def test_padded_batches_group_lengths_and_mask_padding(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    batches = PaddedBatches(examples(3, 9, 4, 8, 2), batch_size=2, seed=0, pad_id=0)
    assert batches.batches_per_epoch == 3  # 5 examples: the last batch holds one, none is dropped
    epoch = [batches.batch(i) for i in range(3)]
    assert sorted(int(b["attention_mask"].sum()) for b in epoch) == sorted([9 + 8, 4 + 3, 2])
    assert all((b["labels"][b["attention_mask"] == 0] == IGNORE).all() for b in epoch)
    widths = [b["input_ids"].shape[1] for b in epoch]
    assert widths == sorted(widths, reverse=True)  # longest first within a window
    # The loss of a padded batch equals the token-weighted loss of its examples run alone.
    model = AutoModelForCausalLM.from_pretrained(save_llama(tmp_path / "llama")).eval()
    batch = epoch[0]
    with torch.no_grad():
        padded = lm_loss(model, batch)
        losses, counts = [], []
        for row in range(2):
            n = int(batch["attention_mask"][row].sum())
            alone = {"input_ids": batch["input_ids"][row : row + 1, :n], "labels": batch["labels"][row : row + 1, :n]}
            losses.append(lm_loss(model, alone) * (alone["labels"][:, 1:] != IGNORE).sum())
            counts.append((alone["labels"][:, 1:] != IGNORE).sum())
    torch.testing.assert_close(padded, sum(losses) / sum(counts))
