"""OpenAI's ``method: {type: reinforcement, reinforcement: {grader, hyperparameters}}`` as Ferry's grpo sections.

The grader objects map one to one onto Ferry's (jobs/spec/graders.py), templates and all (``{{item.answer}}``,
``{{sample.output_text}}`` read the same in both); what Ferry cannot do is refused with the request's own path
(``method.reinforcement.grader.image_tag``), never dropped:

- ``string_check``, ``text_similarity`` (every metric; cosine also takes ``embedding_model``, a local encoder
  directory under a model root, where OpenAI embeds with its hosted model), ``multi`` (``graders`` by name,
  ``calculate_output``) as OpenAI defines them;
- ``python``: ``source`` runs in Ferry's sandboxed subprocess; ``image_tag`` is refused (no images here);
- ``score_model``: ``model`` is a model directory under a model root (the judge runs locally), text messages only;
  ``sampling_params`` temperature, top_p, seed, max_completions_tokens; ``reasoning_effort`` is refused;
- ``label_model`` is an evals grader, refused as OpenAI's reinforcement fine-tuning refuses it.

Hyperparameters: ``n_epochs``, ``batch_size`` and ``learning_rate_multiplier`` as for supervised jobs (auto: chosen
by OpenAI's rules from the prompts that fit the context, jobs/data/auto_size.py);
``compute_multiplier`` scales the completions sampled per prompt (``training.grpo.num_generations``, 8 at 1);
``eval_interval``, ``eval_samples`` and ``reasoning_effort`` are refused unless auto/default (a grpo job reports
its rewards each step and runs no evaluation).
"""

from __future__ import annotations

from typing import Any

from service.api.errors import ApiError

BASE_GENERATIONS = 8  # training.grpo.num_generations at compute_multiplier 1 (TRL's default group)
METHOD = "method.reinforcement"
_TYPES = ("string_check", "text_similarity", "python", "score_model", "multi")
_KEYS = {
    "string_check": {"type", "name", "input", "reference", "operation"},
    # embedding_model: Ferry's own, the local encoder a cosine grader embeds with (OpenAI embeds with its own model).
    "text_similarity": {"type", "name", "input", "reference", "evaluation_metric", "embedding_model"},
    "python": {"type", "name", "source", "image_tag"},
    "score_model": {"type", "name", "model", "input", "range", "sampling_params"},
    "multi": {"type", "name", "graders", "calculate_output"},
}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "max_completions_tokens": "max_new_tokens"}


def ferry_grader(grader: Any, param: str = f"{METHOD}.grader", *, inside_multi: bool = False) -> dict[str, Any]:
    """Ferry's grader section for OpenAI's grader object ``grader``; a 400 naming ``param.<field>`` otherwise."""
    if not isinstance(grader, dict):
        raise _bad(param, f"must be a grader object with a type ({', '.join(_TYPES)})")
    kind = grader.get("type")
    if kind == "label_model":
        raise _bad(f"{param}.type", "label_model grades evals, not reinforcement fine-tuning; use score_model")
    allowed = _TYPES[:-1] if inside_multi else _TYPES
    if kind not in allowed:
        raise _bad(f"{param}.type", f"must be one of {', '.join(allowed)}; got {kind!r}")
    unknown = sorted(set(grader) - _KEYS[kind])
    if unknown:
        raise _bad(f"{param}.{unknown[0]}", f"is no field of a {kind} grader ({', '.join(sorted(_KEYS[kind]))})")
    if kind == "python":
        return _python(grader, param)
    if kind == "score_model":
        return _score_model(grader, param)
    if kind == "multi":
        return _multi(grader, param)
    return dict(grader)  # string_check, text_similarity: the same fields, checked by Ferry's spec


def num_generations(compute_multiplier: Any) -> int:
    """``training.grpo.num_generations`` for OpenAI's ``compute_multiplier`` (auto: 1)."""
    multiplier = 1.0 if compute_multiplier in (None, "auto") else float(compute_multiplier)
    generations = round(BASE_GENERATIONS * multiplier)
    if generations < 2:
        raise _bad(
            f"{METHOD}.hyperparameters.compute_multiplier",
            f"samples {BASE_GENERATIONS} × {multiplier:g} = {generations} completion(s) per prompt; a group needs "
            f"at least 2: give at least {2 / BASE_GENERATIONS:g}",
        )
    return generations


def refuse_unsupported(hyperparameters: Any, validation_file: str | None) -> None:
    """A 400 for what a grpo job cannot do: evaluation, reasoning effort."""
    where = f"{METHOD}.hyperparameters"
    for name in ("eval_interval", "eval_samples"):
        if getattr(hyperparameters, name) not in (None, "auto"):
            raise _bad(
                f"{where}.{name}",
                "Ferry's reinforcement jobs report rewards each step and do not evaluate; leave it auto",
            )
    if hyperparameters.reasoning_effort not in (None, "default"):
        raise _bad(f"{where}.reasoning_effort", "Ferry's models have no reasoning effort setting; leave it default")
    if validation_file:
        raise _bad("validation_file", "Ferry's reinforcement jobs do not evaluate yet; leave validation_file out")


def request_param(path: str, grader: Any) -> str | None:
    """The request field behind spec path ``path`` of a reinforcement job whose request grader is ``grader``
    (``training.grpo.grader.graders.0.reference`` → ``method.reinforcement.grader.graders.<name>.reference``)."""
    if path == "training.grpo.num_generations":
        return f"{METHOD}.hyperparameters.compute_multiplier"
    if path != "training.grpo.grader" and not path.startswith("training.grpo.grader."):
        return None
    parts, param = path.split(".")[3:], f"{METHOD}.grader"
    if len(parts) >= 2 and parts[0] == "graders" and parts[1].isdigit() and isinstance(grader, dict):
        names = list((grader.get("graders") or {}).keys()) if isinstance(grader.get("graders"), dict) else []
        index = int(parts[1])
        if index < len(names):
            param, parts = f"{param}.graders.{names[index]}", parts[2:]
    if parts and parts[0] in _SAMPLING.values():  # a score_model's sampling, as OpenAI nests it
        openai_name = next(k for k, v in _SAMPLING.items() if v == parts[0])
        parts = ["sampling_params", openai_name, *parts[1:]]
    return ".".join([param, *parts])


def _python(grader: dict[str, Any], param: str) -> dict[str, Any]:
    if grader.get("image_tag") is not None:
        raise _bad(
            f"{param}.image_tag", "Ferry runs python graders in its own sandboxed Python, not images; leave it out"
        )
    if not isinstance(grader.get("source"), str):
        raise _bad(f"{param}.source", "must be the grader's Python code, defining grade(sample, item) -> float")
    return {key: value for key, value in grader.items() if key != "image_tag"}


def _score_model(grader: dict[str, Any], param: str) -> dict[str, Any]:
    messages = grader.get("input")
    if not isinstance(messages, list) or not messages:
        raise _bad(f"{param}.input", "must be a non-empty list of {role, content} messages")
    ferry: dict[str, Any] = {key: grader[key] for key in ("type", "name", "model", "range") if key in grader}
    ferry["input"] = [_message(message, f"{param}.input.{index}") for index, message in enumerate(messages)]
    sampling = grader.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise _bad(f"{param}.sampling_params", "must be an object")
    for key, value in sampling.items():
        if key not in _SAMPLING and value is not None:
            raise _bad(
                f"{param}.sampling_params.{key}",
                f"Ferry's local judge takes {', '.join(_SAMPLING)}; leave {key} out",
            )
        if key in _SAMPLING and value is not None:
            ferry[_SAMPLING[key]] = value
    return ferry


def _message(message: Any, param: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _bad(param, "must be a {role, content} message")
    content = message.get("content")
    if isinstance(content, dict) and content.get("type") in ("input_text", "output_text"):
        content = content.get("text")
    if not isinstance(content, str):
        raise _bad(f"{param}.content", "Ferry's judge reads text: a string or {type: input_text, text}")
    unknown = sorted(set(message) - {"role", "content", "type"})
    if unknown:
        raise _bad(f"{param}.{unknown[0]}", "is no field of a message (role, content, type)")
    return {"role": message.get("role"), "content": content}


def _multi(grader: dict[str, Any], param: str) -> dict[str, Any]:
    graders = grader.get("graders")
    if not isinstance(graders, dict) or not graders:
        raise _bad(f"{param}.graders", "must map names (used in calculate_output) to grader objects")
    if not isinstance(grader.get("calculate_output"), str):
        raise _bad(f"{param}.calculate_output", "must be a formula over the graders' names, e.g. 0.5 * a + 0.5 * b")
    inner = [
        {**ferry_grader(inner, f"{param}.graders.{name}", inside_multi=True), "name": name}
        for name, inner in graders.items()
    ]
    return {
        "type": "multi",
        "name": grader.get("name", "multi"),
        "graders": inner,
        "calculate_output": grader["calculate_output"],
    }


def _bad(param: str, message: str) -> ApiError:
    from service.api.openai.create import request_error

    return request_error(param, f"{param}: {message}")
