"""The model's processor (tokenizer, chat template, image processor) from its directory, and what the data needs
of it: render a conversation, tokenize a piece of it with its images expanded, batch images.

Loaded with ``AutoProcessor`` (never downloaded, no remote code). A processor whose video half needs torchvision
(Qwen2.5-VL's, SmolVLM's) loads without it as an image-only processor: Ferry trains on images, never on videos.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def load_processor(path: Path) -> Any:
    """``AutoProcessor.from_pretrained(path)``, image-only where the video processor cannot load.

    Raises:
        ValueError: naming ``model.path`` when the directory holds no processor.
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ImportError, OSError, ValueError) as error:
        # A video processor that needs torchvision, or whose own config the directory lacks: images need neither.
        first = error
    try:
        processor = _image_only(_processor_class(path)).from_pretrained(str(path), local_files_only=True)
    except Exception:  # whatever the image-only attempt raises, the first error is the one to show
        raise ValueError(
            f"model.path {path.name}: no processor loads from it ({type(first).__name__}: {first}); an image-text "
            "model's directory holds its processor too (save_pretrained of AutoProcessor: preprocessor_config.json, "
            "tokenizer files, the chat template)"
        ) from None
    log.info("%s: the processor loads for images only (%s: %s)", path.name, type(first).__name__, first)
    return processor


def _processor_class(path: Path) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    found: Any = PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(str(path), local_files_only=True))]
    return found


def _image_only(cls: Any) -> Any:
    """``cls`` without its video processor: transformers builds its sub-processors from ``__init__``'s arguments."""

    def __init__(
        self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ) -> None:
        kwargs.pop("video_processor", None)
        initialize: Any = cls.__init__
        initialize(
            self,
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


class ProcessorText:
    """The processor as the chat format and the batches use it.

    Attributes:
        processor: the transformers processor.
        placeholder: the text a chat template writes for one image (``<|image_pad|>``, ``<image>``,
            ``<start_of_image>``), which the processor expands to the image's tokens.
        pad_id: the id padding takes (labels -100 there).
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder: str = getattr(processor, "boi_token", None) or processor.image_token
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token)

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The conversation through the processor's chat template (image parts as its placeholder), untokenized."""
        template = getattr(self.processor, "chat_template", None) or None
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str, images: list[Any]) -> list[int]:
        """``text``'s ids, each placeholder expanded for its image of ``images`` (as many as placeholders)."""
        if not images:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        encoded = self.processor(text=[text], images=[images], add_special_tokens=False)
        return [int(i) for i in encoded["input_ids"][0]]

    def pixels(self, images: list[list[Any]]) -> dict[str, Any]:
        """The image processor's tensors for a batch's images, one list per row (it pads or flattens them)."""
        return dict(self.processor.image_processor(images=images, return_tensors="pt"))
