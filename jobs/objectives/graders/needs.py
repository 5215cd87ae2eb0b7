"""What a grader needs installed on the machine that runs it, checked when the spec is submitted.

math_answer needs math-verify and text_similarity's metrics come from optional libraries (the ``rl`` extra), meteor from WordNet's data as well and
cosine from an encoder directory; a spec naming one that is missing is refused at submit, naming the grader's path and what to install, instead of
scoring every completion 0 for the length of a job.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from jobs.objectives.graders.math_answer import INSTALL as MATH_VERIFY_INSTALL
from jobs.objectives.graders.wordnet import wordnet_problem
from jobs.spec.graders import each_grader

# The package each text_similarity metric imports, by the metric's name (rouge_*: rouge_score).
_PACKAGES = {"fuzzy_match": "rapidfuzz", "bleu": "nltk", "gleu": "nltk", "meteor": "nltk", "rouge": "rouge_score"}
_PIP_NAMES = {"rapidfuzz": "rapidfuzz", "nltk": "nltk", "rouge_score": "rouge-score"}


def grader_problems(grader: Any) -> list[tuple[str, str]]:
    """(spec path, message) for each grader of the tree ``grader`` this machine cannot run."""
    problems = []
    for path, each in each_grader(grader):
        if each.type == "math_answer" and importlib.util.find_spec("math_verify") is None:
            problems.append((f"{path}.type", MATH_VERIFY_INSTALL))
        if each.type != "text_similarity":
            continue
        metric = each.evaluation_metric
        package = _PACKAGES.get("rouge" if metric.startswith("rouge_") else metric)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(
                (
                    f"{path}.evaluation_metric",
                    f"{metric} is computed by {_PIP_NAMES[package]}, which is not installed: "
                    f"pip install 'ferry[rl]' (or pip install {_PIP_NAMES[package]})",
                )
            )
        elif metric == "meteor" and (problem := wordnet_problem()) is not None:
            problems.append((f"{path}.evaluation_metric", problem))
        elif metric == "cosine" and not (Path(each.embedding_model) / "config.json").is_file():
            problems.append(
                (
                    f"{path}.embedding_model",
                    "holds no config.json: point it at a sentence-transformers or transformers encoder directory "
                    "(as save_pretrained or SentenceTransformer.save writes it)",
                )
            )
    return problems
