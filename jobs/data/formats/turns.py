"""Which tokens of a rendered conversation train: its assistant turns, found one of three ways.

- The template marks them (``{% generation %}`` ... ``{% endgeneration %}``, as TRL's training templates and
  SmolLM3's do): transformers' ``apply_chat_template(return_assistant_tokens_mask=True)`` gives the marked
  tokens, which train as TRL's ``assistant_only_loss`` trains them.
- The template renders turn by turn (each prefix of the conversation renders as the start of the whole:
  ChatML, Qwen2.5, Llama 3): the text is cut at each assistant turn's start and end, as axolotl and torchtune
  cut it, and each piece is tokenized on its own, so the labels follow the pieces exactly.
- The template renders earlier turns differently from the last (Qwen3's drops their reasoning and the
  ``<think>`` block it writes on the last turn): each assistant turn trains in an example of its own, the
  conversation up to and including that turn, rendered as the model sees it when it writes that turn (the
  earlier turns as history, masked). A conversation with n trained turns makes n examples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from jobs.data.formats.examples import IGNORE, Example, RecordError

if TYPE_CHECKING:  # checking messages needs no torch: the API process checks uploaded rows with it
    from jobs.data.tokenizers import HFTokenizer

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> the text
Pieces = list[tuple[str, bool]]  # (text, trains)


def conversation_examples(
    messages: list[dict[str, Any]],
    weights: list[int],
    tokenizer: HFTokenizer,
    render: Render,
    *,
    train_on_prompt: bool,
    tools: list[dict[str, Any]] | None,
    field: str,
) -> list[Example]:
    """The examples of a conversation as the template reads it (``messages``), ``weights`` one per message.

    Labels are the ids of the assistant turns of weight 1 (everything but weight-0 turns with
    ``train_on_prompt``) and -100 elsewhere. One example, or one per trained assistant turn where the
    template renders earlier turns differently from the last (see the module docstring).

    Raises:
        RecordError: on ``field``, naming why no turn can be told apart and the fix.
    """
    if tokenizer.marks_generation:
        return [_marked(messages, weights, tokenizer, tools, train_on_prompt=train_on_prompt, field=field)]
    pieces = _turn_pieces(messages, weights, render, train_on_prompt=train_on_prompt)
    if pieces is not None:
        return [_encoded(pieces, tokenizer)]
    if train_on_prompt:
        raise RecordError(
            field,
            "the chat template renders earlier turns differently from the last (Qwen3's drops their <think> "
            "blocks), so each assistant turn trains in an example of its own, and data.train_on_prompt would "
            "train every earlier turn again in each later one; set data.train_on_prompt: false, or "
            "data.chat_template to one that renders turn by turn",
        )
    return [_encoded(pieces, tokenizer) for pieces in _each_turn(messages, weights, render, field)]


def _turn_pieces(
    messages: list[dict[str, Any]], weights: list[int], render: Render, *, train_on_prompt: bool
) -> Pieces | None:
    """The conversation cut at each assistant turn, or None where a later turn changes earlier text."""
    pieces: Pieces = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:index], True) if index else ""
        full = render(messages[: index + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            return None
        pieces += [(prompt[len(done) :], train_on_prompt), (full[len(prompt) :], weights[index] == 1)]
        done = full
    whole = render(messages, False)
    if not whole.startswith(done):
        return None
    return [*pieces, (whole[len(done) :], train_on_prompt)]


def _each_turn(messages: list[dict[str, Any]], weights: list[int], render: Render, field: str) -> Iterator[Pieces]:
    """One example's pieces per assistant turn of weight 1: its prompt as context, then the turn."""
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or weights[index] != 1:
            continue
        prompt = render(messages[:index], True) if index else ""
        full = render(messages[: index + 1], False)
        if not full.startswith(prompt):
            raise RecordError(
                field,
                f"the chat template does not render assistant turn {index} after its own prompt (the "
                "conversation up to it with the assistant's header), so the turn cannot be told apart; set "
                "data.chat_template to one that does",
            )
        yield [(prompt, False), (full[len(prompt) :], True)]


def _encoded(pieces: Pieces, tokenizer: HFTokenizer) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    for text, trains in pieces:
        piece = tokenizer.encode(text) if text else []
        ids += piece
        labels += piece if trains else [IGNORE] * len(piece)
    return Example(ids, labels)


def _marked(
    messages: list[dict[str, Any]],
    weights: list[int],
    tokenizer: HFTokenizer,
    tools: list[dict[str, Any]] | None,
    *,
    train_on_prompt: bool,
    field: str,
) -> Example:
    """The whole conversation tokenized once, labels on the template's ``{% generation %}`` tokens.

    The k-th marked run of tokens is the k-th assistant turn, so a weight-0 turn is found and masked."""
    ids, mask = tokenizer.assistant_mask(messages, tools)
    runs = _runs(mask)
    turns = [weights[i] for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not runs:
        raise RecordError(
            field,
            "the chat template's {% generation %} blocks mark no text of this conversation, so nothing would "
            "train; set data.chat_template to one that marks the assistant turns",
        )
    if len(runs) != len(turns) and 0 in turns:
        raise RecordError(
            field,
            f"the chat template marks {len(runs)} stretch(es) of text with {{% generation %}} for {len(turns)} "
            "assistant turn(s), so a weight-0 turn cannot be found; give every assistant turn weight 1, or set "
            "data.chat_template to one that marks each assistant turn once",
        )
    trains = [train_on_prompt] * len(ids)
    for index, (start, end) in enumerate(runs):
        weight = turns[index] if len(runs) == len(turns) else 1
        trains[start:end] = [weight == 1] * (end - start)
    return Example(ids, [i if t else IGNORE for i, t in zip(ids, trains, strict=True)])


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """The (start, end) of each stretch of 1s in ``mask``."""
    runs: list[tuple[int, int]] = []
    for index, bit in enumerate(mask):
        if bit and runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        elif bit:
            runs.append((index, index + 1))
    return runs
