"""data.mix: sources mixed by weight, deterministic per seed, each checked at submit like data.path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs import JobSpecError, PathRoots, load_job_spec
from jobs.data.mixing import mix
from jobs.data.prepare import prepare_text_data
from jobs.spec.preflight import preflight_problems
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl

MIX = [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 2}]


def test_mix_fills_each_share_of_the_epoch_and_repeats_exactly_per_seed() -> None:
    a, b = [f"a{i}" for i in range(30)], [f"b{i}" for i in range(10)]
    mixed, counts = mix([a, b], [1.0, 3.0], seed=7)
    assert counts == [10, 30] and len(mixed) == 40
    assert sorted(x for x in mixed if x.startswith("b")) == sorted(b * 3)  # b repeated whole, three times
    assert len({x for x in mixed if x.startswith("a")}) == 10  # a: a sample of 10 distinct records
    assert mix([a, b], [1.0, 3.0], seed=7) == (mixed, counts)
    assert mix([a, b], [1.0, 3.0], seed=8)[0] != mixed


@pytest.fixture
def roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "a.jsonl", [chat_record(i) for i in range(12)])
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(4)])
    sharegpt = [
        {"conversations": [{"from": "human", "value": f"the fox {i}"}, {"from": "gpt", "value": "jumps"}]}
        for i in range(6)
    ]
    write_jsonl(data / "b.jsonl", sharegpt)
    return PathRoots(model_roots=[models], data_roots=[data])


def spec_of(roots: PathRoots, **sections: object):
    data = llm_spec(**sections)
    data["data"].pop("path")
    data["data"]["mix"] = sections.get("mix", MIX)
    data.pop("mix", None)
    return load_job_spec(yaml.safe_dump(data), roots)


def test_a_mixed_job_reads_every_source_in_its_share(roots: PathRoots) -> None:
    spec = spec_of(roots, eval={"split": 0.25})
    text = prepare_text_data(spec.data, batch_size=2, seed=0, packed_path=True, eval_spec=spec.eval)
    # 9 + 4 training records after the split (3 + 2 held out): 1/3 of 13 from a.jsonl, 2/3 from b.jsonl
    # (a seeded sample of a's, b's twice over and one more), every held-out record left out of the mix.
    assert text.summary.endswith("; data.mix (records -> in the mix): a.jsonl 9 -> 4, b.jsonl 4 -> 9")
    assert "13 record(s) -> 13 example(s)" in text.summary and "5 record(s) held out for eval" in text.summary
    again = prepare_text_data(spec.data, batch_size=2, seed=0, packed_path=True, eval_spec=spec.eval)
    assert all((text.train.batch(i)["input_ids"] == again.train.batch(i)["input_ids"]).all() for i in range(3))


def test_mix_sources_are_confined_and_checked_at_submit(roots: PathRoots) -> None:
    with pytest.raises(JobSpecError) as error:
        spec_of(roots, mix=[{"path": "../../etc/passwd"}, {"path": "b.jsonl", "weight": 0}])
    assert {p.path for p in error.value.problems} == {"data.mix.0.path", "data.mix.1.weight"}
    both = llm_spec(data={"mix": MIX})
    with pytest.raises(JobSpecError) as error:
        load_job_spec(yaml.safe_dump(both), roots)
    assert [(p.path, p.message) for p in error.value.problems] == [
        ("data.path", "give exactly one of data.path and data.mix (a list of {path, weight})")
    ]
    assert preflight_problems(spec_of(roots)) == []
    write_jsonl(roots.data_roots[0] / "b.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])
    (found,) = preflight_problems(spec_of(roots))
    assert (found.path, found.message) == (
        "data.mix.1.path",
        "b.jsonl row 1: field 'conversations[0].from': must be one of human, gpt, system, user, assistant, tool; "
        "got 'bot' (data.format: chat)",
    )
