"""Text samples stop where transformers' ``generate`` stops: the EOS, the model's ``generation_config`` EOS ids
and the chat template's end-of-turn token, which here (as in many chat models) is not the tokenizer's EOS."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from jobs.data.tokenizers import HFTokenizer
from jobs.evaluate.text_samples import end_of_turn_id, generate_samples, stop_ids
from tests.jobs.llm_helpers import save_bpe_tokenizer


class Scripted(nn.Module):
    """A model that writes ``script`` after the prompt, one token a forward, then repeats its last token."""

    def __init__(self, prompt_len: int, script: list[int], vocab: int) -> None:
        super().__init__()
        self.prompt_len, self.script, self.vocab = prompt_len, script, vocab
        self.generation_config = SimpleNamespace(eos_token_id=None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        written = input_ids.shape[1] - self.prompt_len
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, self.script[min(written, len(self.script) - 1)]] = 1.0
        return logits


def chatml_tokenizer_whose_eos_is_not_the_end_of_turn(tmp_path: Path) -> HFTokenizer:
    from transformers import AutoTokenizer

    directory = save_bpe_tokenizer(tmp_path / "tok")  # ChatML: turns end with <|im_end|>
    hf = AutoTokenizer.from_pretrained(str(directory))
    hf.eos_token = "<|endoftext|>"  # as SmolLM2's base, Llama 3's <|end_of_text|> beside <|eot_id|>
    hf.save_pretrained(str(directory))
    return HFTokenizer(directory)


def test_a_chat_sample_stops_at_the_templates_end_of_turn(tmp_path: Path) -> None:
    tokenizer = chatml_tokenizer_whose_eos_is_not_the_end_of_turn(tmp_path)
    end_of_turn = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_id != end_of_turn and end_of_turn_id(tokenizer) == end_of_turn
    spec = SimpleNamespace(
        text_samples=SimpleNamespace(prompts=["Capital of Italy?"], max_new_tokens=40),
        data=SimpleNamespace(format="chat", seq_len=128),
    )
    from jobs.data.formats.chat import chat_prompt

    prompt_len = len(tokenizer.encode(chat_prompt("Capital of Italy?", tokenizer)))
    answer = tokenizer.encode("ANSWER: Rome.")
    model = Scripted(prompt_len, [*answer, end_of_turn, *answer, end_of_turn], tokenizer.vocab_size)
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext)
    (sample,) = generate_samples(model, spec, tokenizer, device=torch.device("cpu"), accelerator=accelerator)
    assert sample["completion"] == "ANSWER: Rome."  # the old sampler went on: "ANSWER: Rome.ANSWER: Rome."


def test_the_models_generation_config_eos_ids_stop_too(tmp_path: Path) -> None:
    tokenizer = chatml_tokenizer_whose_eos_is_not_the_end_of_turn(tmp_path)
    model = Scripted(1, [5], tokenizer.vocab_size)
    model.generation_config = SimpleNamespace(eos_token_id=[7, 9])
    assert {7, 9, tokenizer.eos_id, end_of_turn_id(tokenizer)} == set(stop_ids(tokenizer, model))
