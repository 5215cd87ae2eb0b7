"""Tiny vision-language models saved with ``save_pretrained`` (model, tokenizer, processor), as users have them.

Two architectures: Qwen2.5-VL (patches flattened, images of any size, multimodal rotary positions) and Idefics3
(SigLIP tiles padded to the batch's largest, a pixel-shuffle connector, Llama decoder). A byte-level BPE is
trained on a few colour words in the test (seconds); the chat templates render OpenAI's content parts.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import torch

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
WORDS = ["what", "colour", "is", "this", "image", "it", "is", "the", "answer", *COLOURS]

# A template over content parts (strings too), in ChatML; ``image`` parts become the processor's placeholder.
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '@IMAGE@' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IDEFICS_IMAGE = "<image>"


def _tokenizer(special: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=base + special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|endoftext|>"
    )


def save_tiny_qwen2_5_vl(directory: Path, *, max_pixels: int = 56 * 56 * 4, tie_word_embeddings: bool = False) -> Path:
    """A 2-layer Qwen2.5-VL (hidden 32) with a 2-block vision tower, its processor and tokenizer; the output head
    tied to the input embedding with ``tie_word_embeddings`` (as Qwen2.5-VL-3B's is)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|vision_start|>", "<|image_pad|>")}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            fullatt_block_indexes=[1],
            window_size=56,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(directory)
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels)
    # The processor's parts as its save_pretrained writes them (Qwen2_5_VLProcessor itself wants torchvision for
    # its video half, which this environment lacks; Ferry loads it for images only).
    tokenizer.chat_template = _TEMPLATE.replace("@IMAGE@", QWEN_IMAGE)
    tokenizer.save_pretrained(directory)
    images.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(tokenizer.chat_template)
    return directory


def save_tiny_idefics3(directory: Path) -> Path:
    """A 2-layer Idefics3 (Llama decoder, hidden 32) with a 2-layer SigLIP tower on 56-pixel tiles."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"])
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(directory)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 56}, max_image_size={"longest_edge": 56}
    )
    template = _TEMPLATE.replace("@IMAGE@", IDEFICS_IMAGE)
    tokenizer.chat_template = template
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=template)
    processor.save_pretrained(directory)
    return directory


def solid_png(path: Path, colour: str, size: tuple[int, int] = (28, 28)) -> Path:
    """A PNG filled with one of `COLOURS`."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, COLOURS[colour]).save(path)
    return path


def data_url(colour: str, size: tuple[int, int] = (28, 28)) -> str:
    """A ``data:image/png;base64,...`` URL of a solid image."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def colour_record(image: str, colour: str, question: str = "what colour is this image") -> dict[str, Any]:
    """An OpenAI-format row: a user turn with an image part and a question, the colour as the answer."""
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}],
            },
            {"role": "assistant", "content": colour},
        ]
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TINY_VLMS = {"qwen": save_tiny_qwen2_5_vl, "idefics": save_tiny_idefics3}  # two architectures, saved as users have them
