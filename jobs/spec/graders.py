"""The graders of ``training.grpo.grader``: how sampled completions are rewarded, named and shaped as OpenAI's
reinforcement fine-tuning's (``string_check``, ``text_similarity``, ``python``, ``score_model``, ``multi``), and
Ferry's ``math_answer`` (math-verify's equivalence of a final answer to the reference).

Templates read ``{{sample.output_text}}`` (the completion), ``{{sample.output_json.<key>}}`` (the completion read
as JSON) and ``{{item.<column>}}`` (the prompt row's columns; ``{{item.a.b}}`` for nested ones). A template that
names anything else is refused when the spec loads, so a typo costs no training run.

What each grader computes lives in jobs/objectives/graders/; this module is only the spec.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from jobs.spec.formula import formula_problem
from jobs.spec.sections import DataPath, ModelPath, Section, broken_rules

# {{ scope.path }}: the only placeholders a grader's template may hold (OpenAI's templating).
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_PLACEHOLDER = re.compile(r"^(item(\.[A-Za-z0-9_-]+)+|sample\.output_text|sample\.output_json(\.[A-Za-z0-9_-]+)*)$")
# OpenAI's text_similarity metrics, as its grader reference lists them.
SimilarityMetric = Literal[
    "fuzzy_match", "bleu", "gleu", "meteor", "cosine", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"
]


def template_problem(text: str) -> str | None:
    """Why ``text`` is no valid grader template, or None."""
    for match in TEMPLATE.finditer(text):
        if not _PLACEHOLDER.match(match.group(1)):
            return (
                f"{{{{{match.group(1)}}}}} names nothing a grader can read; use {{{{sample.output_text}}}}, "
                "{{sample.output_json.<key>}} or {{item.<column>}}"
            )
    return None


def _checked_template(value: Any) -> Any:
    problem = template_problem(value) if isinstance(value, str) else None
    if problem:
        raise ValueError(problem)
    return value


class StringCheckGrader(Section):
    """OpenAI's ``string_check``: 1 when ``input`` and ``reference`` (templates) pass ``operation`` (eq, ne; like:
    contains, ilike: contains ignoring case), else 0."""

    type: Literal["string_check"]
    name: str = "string_check"
    input: str = "{{sample.output_text}}"
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"] = "eq"

    _templates = field_validator("input", "reference")(_checked_template)


class TextSimilarityGrader(Section):
    """OpenAI's ``text_similarity``: fuzzy_match (rapidfuzz), bleu, gleu and meteor (nltk), rouge_1 to rouge_5 and
    rouge_l (rouge-score's F-measure), 0 to 1; cosine (-1 to 1) of the two texts' embeddings by the local encoder
    ``embedding_model`` (jobs/objectives/graders/similarity.py says how each is computed)."""

    type: Literal["text_similarity"]
    name: str = "text_similarity"
    input: str = "{{sample.output_text}}"
    reference: str
    evaluation_metric: SimilarityMetric = "fuzzy_match"
    embedding_model: ModelPath | None = Field(
        None, description="cosine: a sentence-transformers or transformers encoder directory under a model root"
    )

    _templates = field_validator("input", "reference")(_checked_template)

    @model_validator(mode="after")
    def _check_embedding_model(self) -> TextSimilarityGrader:
        if self.evaluation_metric == "cosine" and self.embedding_model is None:
            raise broken_rules(
                [
                    (
                        "embedding_model",
                        "cosine compares embeddings, and Ferry embeds locally: give embedding_model, a "
                        "sentence-transformers (or transformers encoder) directory under a model root; or use "
                        "another evaluation_metric",
                    )
                ]
            )
        if self.evaluation_metric != "cosine" and self.embedding_model is not None:
            raise broken_rules([("embedding_model", f"only cosine reads it; remove it for {self.evaluation_metric}")])
        return self


class MathAnswerGrader(Section):
    """Ferry's ``math_answer``: 1 when the completion's final answer (LaTeX or plain, e.g. ``\\boxed{1/2}`` or
    ``0.5``) equals ``reference`` mathematically, by math-verify (``pip install 'ferry[rl]'``), else 0."""

    type: Literal["math_answer"]
    name: str = "math_answer"
    input: str = "{{sample.output_text}}"
    reference: str

    _templates = field_validator("input", "reference")(_checked_template)


class PythonGrader(Section):
    """OpenAI's ``python`` grader: ``grade(sample, item) -> float`` from ``file`` (under a data root) or from
    ``source`` (the code itself, as OpenAI's request sends it), run in a subprocess whose working directory is the
    file's folder (a fresh empty one for ``source``), with ``timeout_s`` per completion, ``memory_mb`` of address
    space and no network (jobs/objectives/graders/sandbox.py says what is enforced)."""

    type: Literal["python"]
    name: str = "python"
    file: DataPath | None = Field(None, description="a .py file under a data root defining grade(sample, item)")
    source: str | None = Field(None, max_length=256_000, description="the grader's code, instead of a file")
    timeout_s: float = Field(5.0, gt=0, le=600)
    memory_mb: int = Field(1024, ge=64, le=1_048_576)

    @model_validator(mode="after")
    def _check_file_or_source(self) -> PythonGrader:
        if (self.file is None) == (self.source is None):
            raise broken_rules([("file", "give exactly one of file (a .py under a data root) and source (the code)")])
        if self.source is not None:
            try:
                compile(self.source, "grader.py", "exec")
            except SyntaxError as error:
                raise broken_rules([("source", f"is not valid Python: line {error.lineno}: {error.msg}")]) from None
        return self


class GraderMessage(Section):
    """One message of a score_model grader's prompt; ``content`` is a template."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(min_length=1)

    _templates = field_validator("content")(_checked_template)


class ScoreModelGrader(Section):
    """OpenAI's ``score_model``, with a local model: ``model`` (a causal LM directory under a model root, its
    tokenizer and chat template beside it) reads ``input`` (messages, templates filled in) and answers; the first
    number of its answer, clipped to ``range``, is the reward. Greedy unless ``temperature`` > 0 (then ``top_p`` and
    ``seed`` apply, as OpenAI's ``sampling_params``)."""

    type: Literal["score_model"]
    name: str = "score_model"
    model: ModelPath = Field(description="a Hugging Face causal LM directory under a model root: the judge")
    input: list[GraderMessage] = Field(min_length=1)
    range: tuple[float, float] = (0.0, 1.0)
    max_new_tokens: int = Field(
        16, gt=0, le=4096, description="the judge's answer length (OpenAI's max_completions_tokens)"
    )
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, description="the judge's sampling seed (temperature > 0)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the judge runs, beside the policy")

    @model_validator(mode="after")
    def _check_range(self) -> ScoreModelGrader:
        if not self.range[0] < self.range[1]:
            raise broken_rules([("range", f"must be [low, high] with low < high; got {list(self.range)}")])
        return self


Single = Annotated[
    StringCheckGrader | TextSimilarityGrader | MathAnswerGrader | PythonGrader | ScoreModelGrader,
    Field(discriminator="type"),
]


class MultiGrader(Section):
    """OpenAI's ``multi``: its graders' rewards combined by ``calculate_output`` (a formula over their names:
    ``+ - * / ^``, ``min max abs floor ceil exp sqrt log``, e.g. ``0.7 * exact + 0.3 * fuzzy``) or, without one, by
    ``weights`` (by grader name, default 1) as a weighted sum."""

    type: Literal["multi"]
    name: str = "multi"
    graders: list[Single] = Field(min_length=1)
    weights: dict[str, float] = Field(default_factory=dict)
    calculate_output: str | None = Field(None, max_length=2000, description="a formula over the graders' names")

    @model_validator(mode="after")
    def _weights_name_graders(self) -> MultiGrader:
        names = [grader.name for grader in self.graders]
        if len(set(names)) != len(names):
            raise ValueError(f"multi grader: give each grader its own name; got {names}")
        unknown = sorted(set(self.weights) - set(names))
        if unknown:
            raise ValueError(f"multi grader: weights name no grader: {unknown}; graders are {names}")
        if self.calculate_output is not None:
            if self.weights:
                raise broken_rules([("weights", "give calculate_output or weights, not both")])
            problem = formula_problem(self.calculate_output, names)
            if problem:
                raise broken_rules([("calculate_output", problem)])
        return self


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | MathAnswerGrader | PythonGrader | ScoreModelGrader | MultiGrader,
    Field(discriminator="type"),
]


def each_grader(grader: Any, path: str = "training.grpo.grader") -> Iterator[tuple[str, Any]]:
    """Every grader of the tree ``grader`` (a multi's own and its graders') with its spec path."""
    yield path, grader
    if getattr(grader, "type", None) == "multi":
        for index, inner in enumerate(grader.graders):
            yield from each_grader(inner, f"{path}.graders.{index}")
