"""``text_similarity``'s metrics, each computed by the library OpenAI's grader documentation names for it.

- fuzzy_match: rapidfuzz's ``fuzz.ratio`` (normalised Indel similarity of the two strings), over 100;
- bleu: nltk's ``sentence_bleu`` (n = 1 to 4, equal weights, no smoothing: a text with no matching 4-gram
  scores 0, as nltk's own does);
- gleu: nltk's ``sentence_gleu`` (Google's sentence GLEU, n = 1 to 4);
- meteor: nltk's ``meteor_score`` with WordNet 3.0's synonyms (jobs/objectives/graders/wordnet.py says where
  they come from);
- rouge_1 to rouge_5, rouge_l: the F-measure of Google's rouge-score package (its tokenizer, no stemmer);
- cosine: the cosine of the two texts' embeddings by a local encoder (jobs/objectives/graders/embeddings.py).

bleu, gleu and meteor read whitespace-separated words, as nltk's documented examples do. Every library is
imported on first use, so a job that grades by fuzzy_match needs only rapidfuzz; the spec check refuses a metric
whose library is not installed before the job is queued (jobs/objectives/graders/needs.py).
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any


def fuzzy_match(given: str, reference: str) -> float:
    """rapidfuzz's ratio of the two strings, 0 to 1."""
    from rapidfuzz import fuzz

    return float(fuzz.ratio(given, reference)) / 100


def bleu(given: str, reference: str) -> float:
    """nltk's sentence BLEU of ``given`` against the one ``reference``, 0 to 1."""
    from nltk.translate.bleu_score import sentence_bleu

    with warnings.catch_warnings():  # nltk warns on every text without some n-gram match: one per completion
        warnings.simplefilter("ignore", UserWarning)
        return float(sentence_bleu([reference.split()], given.split()))


def gleu(given: str, reference: str) -> float:
    """nltk's sentence GLEU of ``given`` against the one ``reference``, 0 to 1."""
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([reference.split()], given.split()))


def meteor(given: str, reference: str) -> float:
    """nltk's METEOR of ``given`` against the one ``reference``, 0 to 1, with WordNet 3.0's synonyms."""
    from nltk.translate.meteor_score import meteor_score

    from jobs.objectives.graders.wordnet import wordnet_reader

    return float(meteor_score([reference.split()], given.split(), wordnet=wordnet_reader()))


def rouge(metric: str, given: str, reference: str) -> float:
    """rouge-score's F-measure for ``metric`` (``rouge_1`` .. ``rouge_5``, ``rouge_l``), 0 to 1."""
    name = "rougeL" if metric == "rouge_l" else f"rouge{metric.removeprefix('rouge_')}"
    return float(_rouge_scorer(name).score(reference, given)[name].fmeasure)


@cache
def _rouge_scorer(name: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([name], use_stemmer=False)


def similarity(metric: str, given: str, reference: str) -> float:
    """``metric``'s similarity of ``given`` to ``reference`` for every metric but cosine (which needs a model)."""
    if metric.startswith("rouge_"):
        return rouge(metric, given, reference)
    return _BY_NAME[metric](given, reference)


_BY_NAME = {"fuzzy_match": fuzzy_match, "bleu": bleu, "gleu": gleu, "meteor": meteor}
