"""``text_similarity``'s cosine: the cosine of two texts' embeddings by a local encoder.

OpenAI embeds with its hosted embedding model; Ferry reads none over the network, so the grader names an encoder
directory under a model root (``embedding_model``): a sentence-transformers model or a plain transformers encoder
(``AutoModel`` with its tokenizer beside it). A text's embedding is the mean of its last hidden states over its
tokens (sentence-transformers' mean pooling, its default for most models), so the score is sentence-transformers'
own ``cos_sim`` of ``encode`` for a mean-pooling model. The encoder is loaded once per job on the CPU (the GPU holds
the policy) in float32 and embeds a step's completions in one batch per reference set.
"""

from __future__ import annotations

from pathlib import Path

import torch

MAX_TOKENS = 512  # each text is cut to this many tokens (or the encoder's own limit, when lower)


class Embedder:
    """An encoder directory's model and tokenizer, and the cosine similarity of texts by its embeddings."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        limit = getattr(self.tokenizer, "model_max_length", MAX_TOKENS)
        self.max_tokens = min(MAX_TOKENS, limit) if isinstance(limit, int) and limit > 0 else MAX_TOKENS

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """One mean-pooled embedding per text, ``[len(texts), hidden]``."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def cosine(self, given: list[str], references: list[str]) -> list[float]:
        """The cosine similarity of each ``given`` text to its reference, -1 to 1."""
        embeddings = self.embed([*given, *references])
        first, second = embeddings[: len(given)], embeddings[len(given) :]
        return torch.nn.functional.cosine_similarity(first, second, dim=-1).tolist()
