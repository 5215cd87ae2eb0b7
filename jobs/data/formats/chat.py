"""Chat records: a ``messages`` list rendered with the chat template, loss on assistant turns only.

The template is rendered one turn at a time (``apply_chat_template`` on growing prefixes of the
conversation, as axolotl and torchtune do), so each piece of text is known to be prompt (system, user,
the assistant's header) or response (an assistant turn's content and end-of-turn), and each piece is
tokenized on its own: the labels follow the pieces exactly, whatever the template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobs.data.formats.examples import Example, RecordError

if TYPE_CHECKING:  # checking messages needs no torch: the API process checks uploaded rows with it
    from jobs.data.tokenizers import HFTokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages: Any, field: str, *, need_assistant: bool = True) -> list[dict[str, Any]]:
    """The conversation of a record, checked: a non-empty list of ``{role, content[, weight]}`` with an
    assistant turn to train on (``need_assistant=False``: a prompt, whose completion comes from elsewhere).

    Raises:
        RecordError: naming the offending field, e.g. ``messages[2].role``.
    """
    if not isinstance(messages, list) or not messages:
        raise RecordError(field, f"must be a non-empty list of {{role, content}} objects; got {_shown(messages)}")
    checked = []
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, dict):
            raise RecordError(where, f"must be an object with role and content; got {_shown(message)}")
        role, content, weight = message.get("role"), message.get("content"), message.get("weight")
        if role not in ROLES:
            raise RecordError(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {_shown(role)}")
        if not isinstance(content, str):
            raise RecordError(f"{where}.content", f"must be a string; got {_shown(content)}")
        if weight is not None and (weight not in (0, 1) or isinstance(weight, bool)):
            raise RecordError(f"{where}.weight", f"must be 0 or 1 (OpenAI's per-message weight); got {weight!r}")
        if weight is not None and role != "assistant":
            raise RecordError(f"{where}.weight", "only assistant messages carry a weight")
        checked.append({"role": role, "content": content, "weight": 1 if weight is None else weight})
    if need_assistant and not any(m["role"] == "assistant" for m in checked):
        raise RecordError(field, "has no assistant message, so there is nothing to train on")
    return checked


def chat_example(messages: list[dict[str, Any]], tokenizer: HFTokenizer, *, train_on_prompt: bool) -> Example:
    """Tokens and labels of a checked conversation (see `check_messages`).

    Labels are the token ids for assistant turns of weight 1 (everything, with ``train_on_prompt``, except
    weight-0 turns) and -100 elsewhere.

    Raises:
        RecordError: the template fails, or does not render the conversation turn by turn.
    """
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    pieces: list[tuple[str, bool]] = []  # (text, trains)
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, plain[:index], generation_prompt=True) if index else ""
        full = _render(tokenizer, plain[: index + 1], generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RecordError(
                "messages",
                "the chat template does not render the conversation turn by turn (a later turn changes "
                "earlier text), so responses cannot be told apart; set data.chat_template to one that does",
            )
        pieces += [(prompt[len(done) :], train_on_prompt), (full[len(prompt) :], message["weight"] == 1)]
        done = full
    pieces.append((_render(tokenizer, plain, generation_prompt=False)[len(done) :], train_on_prompt))
    ids: list[int] = []
    labels: list[int] = []
    for text, trains in pieces:
        piece = tokenizer.encode(text) if text else []
        ids += piece
        labels += piece if trains else [-100] * len(piece)
    return Example(ids, labels)


def chat_prompt(prompt: str, tokenizer: HFTokenizer) -> str:
    """A sample prompt as the model sees it in chat training: one user turn and the assistant's header."""
    return _render(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)


def conversation_prompt(messages: list[dict[str, str]], tokenizer: HFTokenizer) -> str:
    """A sample prompt given as chat messages (a system prompt too), followed by the assistant's header."""
    return _render(tokenizer, messages, generation_prompt=True)


def _render(tokenizer: HFTokenizer, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=generation_prompt)
    except Exception as error:  # jinja2's TemplateError and whatever a template raises
        raise RecordError("messages", f"the chat template failed: {type(error).__name__}: {error}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
