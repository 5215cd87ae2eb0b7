"""The text graders: ``string_check`` (OpenAI's four operations) and ``text_similarity``'s metrics.

fuzzy_match is difflib's ratio; bleu is sacrebleu's sentence BLEU (when installed); gleu is Google's sentence
GLEU (the lower of n-gram precision and recall, n = 1 to 4, nltk's definition); rouge_n and rouge_l are the F1 of
n-gram and longest-common-subsequence overlap (the rouge-score package's, without its stemmer). Tokens are the
lower-cased whitespace-separated words.
"""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Any

from jobs.objectives.graders.templates import render


def string_check(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """1.0 when the rendered input and reference pass ``spec.operation``, else 0.0."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    if spec.operation == "eq":
        return float(given == reference)
    if spec.operation == "ne":
        return float(given != reference)
    if spec.operation == "like":
        return float(reference in given)
    return float(reference.lower() in given.lower())  # ilike


def text_similarity(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """Similarity of the rendered input to the reference, 0 to 1, by ``spec.evaluation_metric``."""
    given, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    metric = spec.evaluation_metric
    if metric == "fuzzy_match":
        return difflib.SequenceMatcher(None, given, reference).ratio()
    if metric == "bleu":
        try:
            import sacrebleu  # type: ignore[import-not-found]
        except ImportError as error:
            raise ValueError("text_similarity bleu needs sacrebleu (pip install sacrebleu); or use gleu") from error
        return float(sacrebleu.sentence_bleu(given, [reference]).score) / 100
    hypothesis, target = given.lower().split(), reference.lower().split()
    if metric == "gleu":
        return gleu(hypothesis, target)
    if metric == "rouge_l":
        return _f1(_lcs(hypothesis, target), len(hypothesis), len(target))
    n = int(metric.removeprefix("rouge_"))
    overlap = sum((_ngrams(hypothesis, n) & _ngrams(target, n)).values())
    return _f1(overlap, max(len(hypothesis) - n + 1, 0), max(len(target) - n + 1, 0))


def gleu(hypothesis: list[str], reference: list[str], max_n: int = 4) -> float:
    """Sentence GLEU: matching n-grams (n = 1 to ``max_n``) over the larger of the two sides' n-gram counts."""
    matches = total_hyp = total_ref = 0
    for n in range(1, max_n + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches += sum((hyp & ref).values())
        total_hyp, total_ref = total_hyp + sum(hyp.values()), total_ref + sum(ref.values())
    denominator = max(total_hyp, total_ref)
    return matches / denominator if denominator else 0.0


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _lcs(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _f1(overlap: int, hypothesis: int, reference: int) -> float:
    if not overlap or not hypothesis or not reference:
        return 0.0
    precision, recall = overlap / hypothesis, overlap / reference
    return 2 * precision * recall / (precision + recall)
