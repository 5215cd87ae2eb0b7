"""The ``math_answer`` grader: whether a completion's final answer equals the reference mathematically.

math-verify (Hugging Face's, the extra ``ferry[rl]``) reads both sides (LaTeX, ``\\boxed{}``, plain numbers and
expressions) into SymPy and compares them: ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are one answer. A reference that
does not parse is an error (reward 0, logged once); a completion with no answer in it scores 0.
"""

from __future__ import annotations

import threading
from typing import Any

from jobs.objectives.graders.templates import render

INSTALL = "the math_answer grader needs math-verify: pip install 'ferry[rl]' (or pip install math-verify)"


def math_answer(spec: Any, completion: str, row: dict[str, Any]) -> float:
    """1.0 when the rendered input's answer equals the rendered reference, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ValueError(INSTALL) from error
    # math-verify bounds its SymPy work with signal.alarm, which only the main thread may set (a test server runs
    # jobs in threads): elsewhere it runs unbounded.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    reference = render(spec.reference, completion, row)
    gold = parse(_as_math(reference), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math_answer: the reference {reference[:60]!r} holds no answer math-verify can read")
    answer = parse(render(spec.input, completion, row), parsing_timeout=limit)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=limit))


def _as_math(text: str) -> str:
    # A bare reference (``42``, ``1/2``) is read as is; math-verify looks for LaTeX delimiters or numbers in text.
    return text if "$" in text or "\\" in text else f"${text}$"
