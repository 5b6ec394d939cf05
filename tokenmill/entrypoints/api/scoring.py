"""Scoring two texts with a pooling model, the same way for the offline `LLM.score` and the
score / rerank routes: a cross-encoder (a classifier of one label) reads the pair as one
input (the tokenizer's pair encoding) and gives its sigmoid; an embedding model embeds each
text and gives their cosine similarity (vLLM's rules)."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.sampling_params import InvalidParameter


def is_cross_encoder(pooler: Any) -> bool:
    """Whether the model scores pairs itself (a classifier), not by cosine of embeddings."""
    return pooler.task == "classify"


def check_scorer(pooler: Any) -> None:
    """A model that can score: an embedding model, or a classifier of one label."""
    if pooler is None:
        raise InvalidParameter("model", "This model generates text; scoring needs an "
                               "embedding model or a cross-encoder (--runner pooling).")
    if pooler.task == "classify" and pooler.num_labels != 1:
        raise InvalidParameter("model", f"This classifier has {pooler.num_labels} labels; "
                               "scoring needs a cross-encoder of one label.")


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others (1:N), or N:N in order."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidParameter("text_1", "Both sides of a score need at least one text.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidParameter("text_2", f"text_1 has {len(first)} texts and text_2 "
                               f"{len(second)}: give one text_1, or as many as text_2.")
    return list(zip(first, second))


def pair_token_ids(tokenizer: Any, first: str, second: str) -> list[int]:
    """A cross-encoder's input: the pair as its tokenizer joins two texts (what
    sentence-transformers' CrossEncoder feeds the model)."""
    return tokenizer(first, second)["input_ids"]


def cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    norm = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norm if norm else 0.0
