"""The two token rules every front end and the engine share, each returning a typed refusal
(None: the request passes) that its caller phrases in its own error shape: token ids inside
the vocabulary, and a prompt plus the completion it asks for inside the context."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenOutOfRange:
    """A token id outside [0, vocab_size)."""

    token: int
    vocab_size: int

    def message(self, what: str) -> str:
        """`what` names the field: "Prompt token ids", "logit_bias token ids", "tokens"."""
        return f"{what} must be in [0, {self.vocab_size})."


def token_out_of_range(ids: Iterable[int], vocab_size: int) -> TokenOutOfRange | None:
    """The first id of `ids` outside the vocabulary, if any (min / max first: a long prompt
    in range costs two C passes, not a Python loop)."""
    ids = ids if isinstance(ids, (list, tuple)) else list(ids)
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next(TokenOutOfRange(t, vocab_size) for t in ids if not 0 <= t < vocab_size)


@dataclass(frozen=True)
class ContextOverflow:
    """A prompt of `n_prompt` tokens and the `n_completion` tokens it must be able to
    generate do not fit in `max_model_len`; `no_room`: the prompt alone leaves no room for
    one token."""

    n_prompt: int
    n_completion: int
    max_model_len: int

    @property
    def no_room(self) -> bool:
        return self.n_prompt >= self.max_model_len


def context_overflow(n_prompt: int, n_completion: int, max_model_len: int
                     ) -> ContextOverflow | None:
    """The length rule: the prompt leaves room for at least one token, and prompt plus
    `n_completion` (the tokens that must fit: max_tokens, or the seed's min_dec_len + 1)
    fits in `max_model_len`."""
    if n_prompt >= max_model_len or n_prompt + n_completion > max_model_len:
        return ContextOverflow(n_prompt, n_completion, max_model_len)
    return None
