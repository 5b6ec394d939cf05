"""Per-request sampling settings of the offline and server APIs, validated on construction."""

from __future__ import annotations

import dataclasses
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.kv_transfer import check_params


class InvalidParameter(ValueError):
    """A request parameter out of its domain; `param` names it (the API error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536  # a schema / regex / grammar's text, or all choices together


@dataclass
class StructuredOutputsParams:
    """What a request asks its output to follow (vLLM's name): exactly one of `json` (a JSON
    schema, as text or a dict), `json_object` (any JSON object), `regex`, `choice` (one of
    these strings) or `grammar` (EBNF / GBNF). Compiled by structured_output/."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # the constraint starts once the output holds these tokens (the end of a reasoning
    # section: set by the server's --reasoning-parser); not part of the grammar
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        asked = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise InvalidParameter(
                "structured_outputs", "structured_outputs takes exactly one of json, "
                f"json_object, regex, choice or grammar; got {asked or 'none'}.")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise InvalidParameter("json", "json must be a JSON schema (an object or its "
                                   "JSON text).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(name, f"{name} must be a non-empty string.")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter("choice", "choice must be a non-empty list of non-empty "
                                   "strings.")
        if self.json_object not in (None, True):
            raise InvalidParameter("json_object", "json_object must be true when given.")
        after = self.after_token_ids
        if after is not None and (not isinstance(after, list) or not after or not all(
                isinstance(t, int) and 0 <= t < 2**63 for t in after)):
            raise InvalidParameter("after_token_ids", "after_token_ids must be a non-empty "
                                   "list of token ids.")
        kind, spec = self.key()
        if len(spec) > MAX_SPEC_CHARS:
            raise InvalidParameter(kind, f"{kind} may be at most {MAX_SPEC_CHARS} characters, "
                                   f"got {len(spec)}.")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, spec text): what the compiled grammar depends on (the cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, _json.dumps(value) if kind == "choice" else str(value)


_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None  # words never generated (any of their tokenizations)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens are generated (vLLM's)
    # the output follows a JSON schema / regex / choice / grammar (structured_output/)
    structured_outputs: StructuredOutputsParams | None = None
    # prefill/decode disaggregation (vLLM's; config/kv_transfer.py): {"do_remote_decode":
    # true} on a prefill instance, its answer's parameters on a decode instance
    kv_transfer_params: dict[str, Any] | None = None
    # Filled by the engine from the tokenizer/generation config; not part of the public surface.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                raise InvalidParameter("structured_outputs", "structured_outputs takes json, "
                                       "json_object, regex, choice or grammar.") from None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return InvalidParameter(name, f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            if not _finite(getattr(self, name)):
                raise bad(name, "a finite number")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", "min_tokens must be <= max_tokens, got "
                                   f"min_tokens={self.min_tokens} and "
                                   f"max_tokens={self.max_tokens}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "a list of non-empty strings")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or not all(isinstance(t, int) and 0 <= t <= _INT64_MAX
                           for t in self.logit_bias)
                or not all(isinstance(v, (int, float)) and _finite(v) and -100 <= v <= 100
                           for v in self.logit_bias.values())):
            raise bad("logit_bias", "a map of token ids to numbers in [-100, 100]")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(
                    isinstance(t, int) and 0 <= t <= _INT64_MAX
                    for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "a non-empty list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "a non-negative integer or None")
        # Integers travel to the engine core as msgpack ints and land in int64 tensors (top_k)
        # or torch.Generator seeds: out of those ranges they would fail there, not here.
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > _INT64_MAX:
                raise bad(name, f"at most {_INT64_MAX}")
        if any(t > _INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"a list of integers in [0, {_INT64_MAX}]")
        if self.seed is not None and not -2**63 <= self.seed <= _UINT64_MAX:  # torch's range
            raise bad("seed", f"an integer in [{-2**63}, {_UINT64_MAX}]")
        if self.kv_transfer_params is not None:
            try:
                self.kv_transfer_params = check_params(self.kv_transfer_params)
            except ValueError as exc:
                raise InvalidParameter("kv_transfer_params", str(exc)) from None
            if self.kv_transfer_params is not None and self.n != 1:
                raise InvalidParameter("kv_transfer_params", "kv_transfer_params needs n=1.")

    def for_child(self, index: int) -> SamplingParams:
        """The params of the `index`-th of `n` samples: with a seed, each its own (seed + index,
        wrapped into the seed range), so seeded samples differ but reproduce."""
        if self.seed is None or self.n == 1:
            return self
        seed = self.seed + index
        return self.clone(seed=seed - 2**64 if seed > _UINT64_MAX else seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)

