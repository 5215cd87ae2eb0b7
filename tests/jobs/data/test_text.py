"""Text data: reading, byte and HF tokenizers, packing, and the resumable order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.data import build_data
from jobs.data.formats.record import Example
from jobs.data.packing import concatenate
from jobs.data.records import iter_records
from jobs.data.text import PackedText
from jobs.data.tokenizers import ByteTokenizer, HFTokenizer
from jobs.spec.job import TextDataSpec


@pytest.mark.parametrize("name", ["run[1]", "a*b?"])
def test_reads_files_whose_path_holds_glob_characters(tmp_path: Path, name: str) -> None:
    # `datasets` takes data_files as glob patterns: unescaped, `run[1]/x.csv` matched no file and read no rows.
    directory = tmp_path / name
    directory.mkdir()
    (directory / "x[a].csv").write_text("text\none\ntwo\n")
    (directory / "y.txt").write_text("three")
    assert [r.fields["text"] for r in iter_records(directory)] == ["one", "two", "three"]


def test_reads_jsonl_and_text(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "b.txt").write_text("three")
    (tmp_path / "ignored.bin").write_bytes(b"\0")
    assert [r.fields["text"] for r in iter_records(tmp_path)] == ["one", "two", "three"]
    assert [(Path(r.file).name, r.row) for r in iter_records(tmp_path)] == [
        ("a.jsonl", 1),
        ("a.jsonl", 3),  # a JSONL row is named by its line, as the upload check names it
        ("b.txt", 1),
    ]


def test_byte_tokenizer_and_packing() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("hé") == [104, 195, 169]
    documents = [Example([97, 98, 256], [97, 98, 256]), Example([99, 100, 256], [99, 100, 256])]
    tensors, counts = concatenate(documents, seq_len=4, pad_id=256, restart_positions=False)
    # The tail is padded (labels -100), not dropped.
    assert tensors["input_ids"].tolist() == [[97, 98, 256, 99], [100, 256, 256, 256]]
    assert tensors["labels"].tolist() == [[97, 98, 256, 99], [100, 256, -100, -100]]
    assert counts.padding_tokens == 2 and counts.sequences == 2


def test_order_is_a_function_of_seed_and_position() -> None:
    source = PackedText(torch.arange(20).view(10, 2), batch_size=3, seed=7)
    assert source.batches_per_epoch == 4  # the last batch of an epoch holds the one row left: none dropped
    first = [source.batch(i)["input_ids"] for i in range(7)]
    again = PackedText(torch.arange(20).view(10, 2), batch_size=3, seed=7)
    assert torch.equal(again.batch(5)["input_ids"], first[5])  # random access, as on resume
    epoch0 = torch.cat([b[:, 0] for b in first[:4]]).tolist()
    assert sorted(epoch0) == list(range(0, 20, 2))  # every row once per epoch
    assert not torch.equal(first[0], first[4])  # reshuffled next epoch


def test_too_little_text_is_an_error() -> None:
    with pytest.raises(ValueError, match="fewer than training.batch_size=4"):
        PackedText(torch.zeros(3, 2, dtype=torch.long), batch_size=4, seed=0)


def save_word_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(directory)
    return directory


def test_local_hf_tokenizer(tmp_path: Path) -> None:
    path = save_word_tokenizer(tmp_path / "tok")
    tokenizer = HFTokenizer(path)
    assert tokenizer.encode("hello world again") == [2, 3, 0] and tokenizer.eos_id == 1
    (tmp_path / "c.txt").write_text("hello world hello")
    spec = TextDataSpec(kind="text", path=tmp_path / "c.txt", seq_len=2, tokenizer={"kind": "hf", "path": path})
    source, vocab = build_data(spec, batch_size=1, seed=0)
    assert vocab == 4 and source.batches_per_epoch == 2
