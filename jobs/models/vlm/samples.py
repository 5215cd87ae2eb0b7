"""Samples of an image-text job: fixed rows of the data (``image_samples``) or the ``text_samples`` prompts, images
included, answered greedily by the current (offloaded) model.

Each sample is a row's conversation up to its last assistant turn, rendered with the generation prompt; the model
answers greedily (no cache: each new token runs the whole prompt again, images included, which a few dozen
tokens a checkpoint afford). The row's first image is written as ``sample-<i>.png`` into the checkpoint, so
the dashboard's gallery shows it with the prompt and the answer (``texts``, read when the sample events are made).
A ``text_samples`` prompt's first image is written once as a thumbnail (at most 256x256) beside the job's samples,
which each of its sample events names, so the dashboard shows the image the answer is about.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.data.records import iter_records
from jobs.models.vlm.images import open_image
from jobs.models.vlm.processor import ProcessorText, load_processor
from jobs.models.vlm.records import image_conversation

END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<end_of_utterance>", "<|eot_id|>")
THUMBNAIL_SIDE = 256  # a text sample's image as the dashboard shows it: small, whatever the prompt's image


class _Answers:
    """Fixed conversations answered greedily by the model: the processor, the prompts' model inputs, the stops.

    Args:
        spec: The job spec (the model's processor, the data section's image settings and folder).
        device: Where the model runs.
        conversations: Each prompt's row fields (``{messages: [...]}``, as the data reads them).
        max_new_tokens: The longest answer.
    """

    def __init__(
        self, spec: Any, device: torch.device, conversations: list[dict[str, Any]], max_new_tokens: int
    ) -> None:
        self.device, self.max_new_tokens = device, max_new_tokens
        self.text = ProcessorText(load_processor(Path(spec.model.path)))
        self.rows = [self._prompt(fields, spec.data) for fields in conversations]
        self.prompts: list[str] = [label for label, _, _ in self.rows]
        tokenizer = self.text.tokenizer
        ids = [tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN if t in tokenizer.get_vocab()]
        self.stops = frozenset(i for i in [tokenizer.eos_token_id, *ids] if i is not None)

    def _prompt(self, fields: dict[str, Any], data: Any) -> tuple[str, list[Any], dict[str, torch.Tensor]]:
        """(label, images, model inputs) of one row: its turns before the last assistant one, the header after."""
        path = Path(data.path)
        folder = path if path.is_dir() else path.parent
        conversation, refs = image_conversation(fields, data, folder, need_assistant=False)
        messages = conversation.messages
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        prompt = self.text.render_chat(messages[:last], add_generation_prompt=True)
        count = prompt.count(self.text.placeholder)
        refuse = data.huge_images == "refuse"
        images = [open_image(r, max_pixels=data.max_image_pixels, refuse_huge=refuse).image for r in refs[:count]]
        ids = torch.tensor([self.text.encode(prompt, images)])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if images:
            inputs |= {k: v for k, v in self.text.pixels([images]).items() if isinstance(v, torch.Tensor)}
        user = [m for m in messages[:last] if m["role"] == "user"]
        words = user[-1]["content"] if user else ""
        words = words if isinstance(words, str) else "".join(p.get("text", "") for p in words)
        names = ", ".join(r.label for r in refs[:count])
        return (f"[{names}] {words}" if names else words), images, inputs

    @torch.no_grad()
    def answer(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> str:
        """The greedy answer to one prompt, up to an end of turn or ``max_new_tokens``; ``model`` left as found."""
        was_training = model.training
        model.eval()
        try:
            batch = {name: tensor.to(self.device) for name, tensor in inputs.items()}
            new: list[int] = []
            for _ in range(self.max_new_tokens):
                if getattr(self.text.processor, "return_mm_token_type_ids", False):
                    batch["mm_token_type_ids"] = (batch["input_ids"] == self.text.image_token_id).long()
                token = int(model(**batch).logits[0, -1].argmax())  # a CPU-GPU sync per token: samples only
                if token in self.stops:
                    break
                new.append(token)
                step = torch.tensor([[token]], device=self.device)
                batch["input_ids"] = torch.cat([batch["input_ids"], step], dim=1)
                batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(step)], dim=1)
            return str(self.text.tokenizer.decode(new, skip_special_tokens=True))
        finally:
            model.train(was_training)

    def close(self) -> None:
        self.rows = []


class ImageSampler(_Answers):
    """Answers the ``image_samples`` rows with the model; ``texts`` holds the last answers, in order."""

    def __init__(self, spec: Any, device: torch.device) -> None:
        section = spec.image_samples
        rows = [record.fields for record in _first(spec.data, section.rows)]
        super().__init__(spec, device, rows, section.max_new_tokens)
        self.every_steps: int = section.every_steps
        self.texts: list[str] = []

    def write(self, model: nn.Module, directory: Path) -> list[str]:
        """Answer every row; write each row's first image as ``sample-<i>.png``; return the files written."""
        self.texts = [self.answer(model, inputs) for _, _, inputs in self.rows]
        written = []
        for index, (_, images, _) in enumerate(self.rows):
            if images:
                images[0].save(directory / f"sample-{index}.png")
                written.append(f"sample-{index}.png")
        return written


class TextSamplePrompts(_Answers):
    """``text_samples.prompts`` of an image-text job answered through the processor: a string is one user turn,
    a list of messages is the conversation, its content parts' images (OpenAI's ``image_url`` parts, a path beside
    the data or a ``data:`` URL) shown to the model; each sample's prompt names its images (``[red.png] ...``)."""

    def __init__(self, spec: Any, device: torch.device) -> None:
        field = spec.data.messages_field
        conversations = [{field: _messages(prompt)} for prompt in spec.text_samples.prompts]
        super().__init__(spec, device, conversations, spec.text_samples.max_new_tokens)

    def generate(self, model: nn.Module) -> list[dict[str, str]]:
        """``{prompt, completion}`` for each prompt, greedy (the same weights give the same text)."""
        return [{"prompt": label, "completion": self.answer(model, inputs)} for label, _, inputs in self.rows]

    def thumbnails(self, directory: Path) -> list[str | None]:
        """Write each prompt's first image, at most 256x256 (aspect kept), as ``prompt-<i>.png`` in
        ``directory``; the file's name for each prompt, None for a prompt without an image."""
        directory.mkdir(parents=True, exist_ok=True)
        names: list[str | None] = []
        for index, (_, images, _) in enumerate(self.rows):
            if not images:
                names.append(None)
                continue
            thumbnail = images[0].copy()
            thumbnail.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            thumbnail.save(directory / f"prompt-{index}.png")
            names.append(f"prompt-{index}.png")
        return names


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": message.role, "content": message.content} for message in prompt]


def _first(data: Any, count: int) -> list[Any]:
    records = []
    for record in iter_records(Path(data.path), data.file_type):
        records.append(record)
        if len(records) == count:
            break
    return records


def make_image_sampler(spec: Any, device: torch.device) -> ImageSampler | None:
    """The ``image_samples`` section's sampler, or None without one."""
    return ImageSampler(spec, device) if getattr(spec, "image_samples", None) is not None else None


def make_text_samples(spec: Any, device: torch.device) -> TextSamplePrompts:
    """What answers the ``text_samples`` section's prompts.

    Raises:
        RecordError: a prompt's image cannot be read (missing, corrupt, outside the data's folder), naming it.
    """
    return TextSamplePrompts(spec, device)
