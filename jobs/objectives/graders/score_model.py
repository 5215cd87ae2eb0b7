"""The ``score_model`` grader with a local judge: a causal LM from a directory under a model root reads the grader's
messages (templates filled in with the completion and its row), answers, and the first number of its answer,
clipped to the grader's ``range``, is the reward.

The judge is loaded once per job, on ``device`` (the CPU by default: the GPU holds the policy), in float32 on the
CPU and bfloat16 on CUDA, and answers one completion at a time, greedily unless ``temperature`` > 0. An answer with
no number in it is an error: reward 0, logged once.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from jobs.objectives.graders.templates import render

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class Judge:
    """A score_model grader's model and tokenizer, and how it scores completions."""

    def __init__(self, spec: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.spec = spec
        self.device = torch.device(spec.device if spec.device == "cpu" or torch.cuda.is_available() else "cpu")
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to oddly

    def score(self, completions: list[str], rows: list[dict[str, Any]]) -> list[float | BaseException]:
        """The clipped score of each completion, or the error that stood in for it."""
        scores: list[float | BaseException] = []
        for completion, row in zip(completions, rows, strict=True):
            try:
                scores.append(self._score(completion, row))
            except Exception as error:
                scores.append(error)
        return scores

    def _score(self, completion: str, row: dict[str, Any]) -> float:
        answer = self.answer([{"role": m.role, "content": render(m.content, completion, row)} for m in self.spec.input])
        found = NUMBER.search(answer)
        if found is None:
            raise ValueError("the judge's answer held no number; ask for one in the grader's messages")
        low, high = self.spec.range
        return min(max(float(found.group()), low), high)

    @torch.no_grad()
    def answer(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply to ``messages`` (its chat template where it has one, else the contents in turn)."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in messages) + "\n"
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(self.device)
        spec = self.spec
        sampling = {"temperature": spec.temperature, "top_p": spec.top_p} if spec.temperature > 0 else {}
        # The judge's own seed, in a forked RNG: the policy's sampling stream is left as it was.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            output = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=spec.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0,
                do_sample=bool(sampling),
                **sampling,
            )
        return str(self.tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True))
