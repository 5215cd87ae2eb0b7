"""Chat records: a ``messages`` list rendered with the chat template, loss on assistant turns only.

Which rendered text is an assistant turn is found as transformers and TRL find it where the template marks
it (``{% generation %}``), else by rendering the conversation one turn at a time (turns.py): the labels
follow the template's own text exactly, also where it renders earlier turns differently from the last.

Tool use renders as the template writes it: an assistant turn's ``tool_calls`` train as its answer, a
``tool`` turn's result is context (masked, as a user turn), and the record's ``tools`` list goes to
``apply_chat_template(tools=...)``, landing in the prompt. Reasoning text on an assistant turn trains as
part of it. Whatever the template leaves out refuses the record (rendering.py): never trained without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from jobs.data.formats.examples import Example, RecordError
from jobs.data.formats.rendering import REASONING_KEYS, check_rendered, template_messages
from jobs.data.formats.tools import check_tool_calls
from jobs.data.formats.turns import conversation_examples

if TYPE_CHECKING:  # checking messages needs no torch: the API process checks uploaded rows with it
    from jobs.data.tokenizers import HFTokenizer


class ChatRenderer(Protocol):
    """What rendering a conversation needs: an `HFTokenizer`, or a processor's chat template."""

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str: ...


ROLES = ("system", "user", "assistant", "tool", "developer")


def check_messages(messages: Any, field: str, *, need_assistant: bool = True) -> list[dict[str, Any]]:
    """The conversation of a record, checked: a non-empty list of ``{role, content[, weight]}`` with an
    assistant turn to train on (``need_assistant=False``: a prompt, whose completion comes from elsewhere).
    ``content`` is a string or OpenAI's text parts (``[{type: text, text}]``, joined); image, audio and file
    parts are refused by name (``messages[0].content[1].type``), never trained as the text around them.

    An assistant turn may carry OpenAI's ``tool_calls`` (its ``content`` then may be empty or null) and
    reasoning text (``reasoning_content``, ``thinking`` or ``reasoning``); a ``tool`` turn may carry
    ``tool_call_id`` and ``name``. These are kept for the chat template, arguments parsed (tools.py).

    Raises:
        RecordError: naming the offending field, e.g. ``messages[2].role``.
    """
    if not isinstance(messages, list) or not messages:
        raise RecordError(field, f"must be a non-empty list of {{role, content}} objects; got {_shown(messages)}")
    checked = [_message(message, f"{field}[{index}]") for index, message in enumerate(messages)]
    if need_assistant and not any(m["role"] == "assistant" for m in checked):
        raise RecordError(field, "has no assistant message, so there is nothing to train on")
    return checked


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RecordError(where, f"must be an object with role and content; got {_shown(message)}")
    role, content, weight = message.get("role"), message.get("content"), message.get("weight")
    if role not in ROLES:
        raise RecordError(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {_shown(role)}")
    if message.get("function_call") is not None:
        raise RecordError(
            f"{where}.function_call",
            "is OpenAI's deprecated single call; write it as tool_calls: [{type: function, function: {name, arguments}}]",
        )
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise RecordError(f"{where}.tool_calls", f"only assistant messages make tool calls; this one is {role}")
    tool_calls = check_tool_calls(calls, f"{where}.tool_calls")
    if content is None and tool_calls:
        content = ""  # OpenAI writes null content beside tool calls; templates concatenate strings
    if isinstance(content, list):
        content = _text_parts(content, f"{where}.content")
    if message.get("audio") is not None:
        raise RecordError(f"{where}.audio", _NOT_TEXT.format(kind="audio"))
    if not isinstance(content, str):
        raise RecordError(f"{where}.content", f"must be a string; got {_shown(content)}")
    if weight is not None and (weight not in (0, 1) or isinstance(weight, bool)):
        raise RecordError(f"{where}.weight", f"must be 0 or 1 (OpenAI's per-message weight); got {weight!r}")
    if weight is not None and role != "assistant":
        raise RecordError(f"{where}.weight", "only assistant messages carry a weight")
    checked: dict[str, Any] = {"role": role, "content": content, "weight": 1 if weight is None else weight}
    if tool_calls:
        checked["tool_calls"] = tool_calls
    if role == "tool":
        checked |= {key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)}
    reasoning = [key for key in REASONING_KEYS if message.get(key) is not None]
    if reasoning:
        key = reasoning[0]
        if len(reasoning) > 1:
            raise RecordError(f"{where}.{reasoning[1]}", f"the message already has {key}; keep one reasoning key")
        if role != "assistant":
            raise RecordError(f"{where}.{key}", f"only assistant messages carry reasoning; this one is {role}")
        if not isinstance(message[key], str):
            raise RecordError(f"{where}.{key}", f"must be a string; got {_shown(message[key])}")
        checked[key] = message[key]
    return checked


def _text_parts(parts: list[Any], field: str) -> str:
    """OpenAI's content parts as the text they hold: ``[{type: text, text}, ...]`` joined as templates that read
    parts join them (one after the other). An image, audio or file part is refused, naming it: dropped, the
    row would train as text on other data than the user's."""
    texts = []
    for index, part in enumerate(parts):
        where = f"{field}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "text":
            raise RecordError(f"{where}.text", f"must be a string; got {_shown(part.get('text'))}")
        elif isinstance(kind, str) and kind in _MEDIA:
            raise RecordError(f"{where}.type", _NOT_TEXT.format(kind=f"{_MEDIA[kind]} content ({kind!r})"))
        else:
            raise RecordError(
                f"{where}.type",
                f"content parts must be {{type: text, text}}; got {_shown(kind if kind is not None else part)}",
            )
    return "".join(texts)


# OpenAI's content parts that are no text, and what they hold.
_MEDIA = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "file": "file",
    "input_file": "file",
    "video": "video",
    "video_url": "video",
    "input_video": "video",
    "refusal": "refusal",
}
_NOT_TEXT = (
    "{kind} cannot be trained: Ferry fine-tunes text models here (data.kind: text), and dropping it would train "
    "the row on other data than yours; remove it, or write it as text ({{type: text, text}} or a string); for "
    "images, train a vision-language model: model.kind: hf_image_text_to_text with data.kind: image_chat"
)


def chat_examples(
    messages: list[dict[str, Any]],
    tokenizer: HFTokenizer,
    *,
    train_on_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    places: list[str] | None = None,
    tools_field: str = "tools",
) -> list[Example]:
    """Tokens and labels of a checked conversation (see `check_messages`), ``tools`` given to the template.

    Labels are the token ids for assistant turns of weight 1 (tool calls and reasoning included; everything,
    with ``train_on_prompt``, except weight-0 turns) and -100 elsewhere (tool results too, as user turns).
    One example, or one per trained assistant turn where the template renders earlier turns differently
    from the last (Qwen3's: turns.py). ``places`` names each message in errors (default ``messages[i]``).

    Raises:
        RecordError: the template fails, its turns cannot be told apart, or it leaves out a tool call, a
            tool result, the tools list or reasoning text (rendering.py).
    """
    places = places or [f"messages[{i}]" for i in range(len(messages))]

    def render(turns: list[dict[str, Any]], with_tools: list[dict[str, Any]] | None = tools) -> str:
        return _render(tokenizer, turns, generation_prompt=False, tools=with_tools)

    def render_turns(turns: list[dict[str, Any]], generation_prompt: bool) -> str:
        return _render(tokenizer, turns, generation_prompt=generation_prompt, tools=tools)

    plain = template_messages(messages, places, render, each_turn=not tokenizer.marks_generation)
    check_rendered(plain, places, tools, render, tools_field)
    return conversation_examples(
        plain,
        [m.get("weight", 1) for m in messages],
        tokenizer,
        render_turns,
        train_on_prompt=train_on_prompt,
        tools=tools,
        field=places[0].split("[")[0],
    )


def chat_pieces(
    messages: list[dict[str, Any]],
    tokenizer: ChatRenderer,
    *,
    train_on_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    places: list[str] | None = None,
    tools_field: str = "tools",
) -> list[tuple[str, bool]]:
    """The conversation's text cut into (piece, trains) pairs: prompt pieces (system, user, tool turns, the
    assistant's header) and response pieces (an assistant turn's content and end-of-turn), in order. Each
    piece is tokenized on its own by the caller (`chat_examples` does so for text; the image-text family expands its images in
    the pieces that hold them), so labels follow the pieces exactly, whatever the template.

    Raises:
        RecordError: as `chat_examples`; also a template that does not render turn by turn.
    """
    places = places or [f"messages[{i}]" for i in range(len(messages))]

    def render(turns: list[dict[str, Any]], with_tools: list[dict[str, Any]] | None = tools) -> str:
        return _render(tokenizer, turns, generation_prompt=False, tools=with_tools)

    plain = template_messages(messages, places, render)
    check_rendered(plain, places, tools, render, tools_field)
    pieces: list[tuple[str, bool]] = []  # (text, trains)
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, plain[:index], generation_prompt=True, tools=tools) if index else ""
        full = render(plain[: index + 1])
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RecordError(
                places[index].split("[")[0],
                "the chat template does not render the conversation turn by turn (a later turn changes "
                "earlier text), so responses cannot be told apart; set data.chat_template to one that does",
            )
        pieces += [(prompt[len(done) :], train_on_prompt), (full[len(prompt) :], message["weight"] == 1)]
        done = full
    pieces.append((render(plain)[len(done) :], train_on_prompt))
    return pieces


def chat_prompt(prompt: str, tokenizer: HFTokenizer) -> str:
    """A sample prompt as the model sees it in chat training: one user turn and the assistant's header."""
    return _render(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)


def conversation_prompt(messages: list[dict[str, str]], tokenizer: HFTokenizer) -> str:
    """A sample prompt given as chat messages (a system prompt too), followed by the assistant's header."""
    return _render(tokenizer, messages, generation_prompt=True)


def _render(
    tokenizer: ChatRenderer,
    messages: list[dict[str, Any]],
    *,
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=generation_prompt, tools=tools)
    except Exception as error:  # jinja2's TemplateError and whatever a template raises
        raise RecordError("messages", f"the chat template failed: {type(error).__name__}: {error}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
