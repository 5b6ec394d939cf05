"""`SpeculativeConfig`: what vLLM's `--speculative-config` JSON and `LLM(speculative_config=)`
take, checked once, with start-up errors that name the problem."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenmill.config.json_flag import json_object

METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3")

# Running requests above which a method stops paying, measured by bench/spec_decode.py on a
# 2-vCPU AVX2 machine (bench/results/spec_decode-2026-11-26-int4-self-k5*.json): the int4
# self-draft gained 1.3-1.9x at 2 requests and 0.8-1.05x at 4; n-gram lookup held 1.0-1.1x
# up to 8 and 0.8-1.3x at 16. MTP's drafts cost about as little as lookup's (one layer), so
# it takes lookup's bound (not measured: no MTP model runs on that machine).
AUTO_OFF_ABOVE = {"ngram": 8, "mtp": 8, "draft_model": 2, "eagle": 2, "eagle3": 2}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the lengths of the context's suffix looked up, longest first (vLLM: both 5 when
    # neither is given, one of them standing for both when only it is)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model / eagle / eagle3: the draft's path
    # the draft's, e.g. "int4"; draft_model without a model: the target loaded so (self-draft)
    quantization: str | None = None
    # speculation off for a step with more running requests than this (None: the method's
    # measured default, AUTO_OFF_ABOVE)
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (None / "" / {}: no speculation)."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config has unknown field(s) {unknown}; known: "
                             f"{sorted(known)}.")
        if "method" not in value:
            drafted = value.get("model") or value.get("quantization")
            value = {**value, "method": "draft_model" if drafted else "ngram"}
        if "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config needs num_speculative_tokens.")
        return cls(**value).validated()

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a request's tokens: draft heads (MTP, EAGLE) write their drafts'
        rows into its blocks; a draft model and n-gram lookup write none there."""
        return self.num_speculative_tokens if self.method in ("mtp", "eagle", "eagle3") else 0

    def validated(self) -> SpeculativeConfig:
        if self.method not in METHODS:
            raise ValueError(f"Unknown speculative method {self.method!r}; choose one of "
                             f"{list(METHODS)}.")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}.")
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f"Speculative method {self.method!r} needs a draft model: set "
                             "\"model\" in --speculative-config.")
        if self.quantization is not None:
            from tokenmill.config import quantization

            object.__setattr__(self, "quantization", quantization.parse_method(self.quantization))
            if self.quantization not in (None, *quantization.METHODS):
                raise ValueError("The draft's quantization must be one of "
                                 f"{', '.join(quantization.METHODS)}, got {self.quantization!r}.")
        if self.method == "draft_model" and not (self.model or self.quantization):
            raise ValueError("Speculative method 'draft_model' needs a draft: \"model\" (its "
                             "path), or \"quantization\" alone for the target itself loaded "
                             "quantized (e.g. \"int4\").")
        if self.method == "mtp" and self.quantization is not None:
            raise ValueError("Speculative method 'mtp' runs the target's own MTP layers, "
                             "quantized as the target is: drop \"quantization\".")
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", AUTO_OFF_ABOVE[self.method])
        limit = self.disable_by_batch_size
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {limit!r}.")
        if self.method != "ngram":
            return self
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}.")
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) is larger than prompt_lookup_max "
                             f"({high}).")
        return SpeculativeConfig(**{**self.__dict__, "prompt_lookup_min": low,
                                    "prompt_lookup_max": high})


# the seed's SPECULATE_METHOD values
SEED_METHODS = {"inference_with_reference": "ngram", "mtp": "mtp", "eagle": "eagle"}


def from_seed(method: str | None, num_draft: int | None, ngram_size: int | None,
              model_path: str | None, quant_type: str | None) -> SpeculativeConfig | None:
    """The seed's SPECULATE_METHOD / _MAX_DRAFT_TOKEN_NUM / _MAX_NGRAM_SIZE / _MODEL_PATH /
    _MODEL_QUANT_TYPE as a config (unset or "None": no speculation; 5 drafts by default;
    its n-gram lookup tries suffixes from SPECULATE_MAX_NGRAM_SIZE down to one token)."""
    if method is None or method == "None":
        return None
    if method not in SEED_METHODS:
        raise ValueError(f"SPECULATE_METHOD must be one of {sorted(SEED_METHODS)} or None, "
                         f"got {method!r}.")
    config: dict[str, Any] = {"method": SEED_METHODS[method],
                              "num_speculative_tokens": 5 if num_draft is None else num_draft}
    if method == "inference_with_reference":
        config.update(prompt_lookup_min=1, prompt_lookup_max=ngram_size or 5)
    elif not model_path:
        raise ValueError("[eagle, mtp] method must be set by env SPECULATE_MODEL_PATH")
    elif method == "mtp":  # the target's own MTP layers, quantized as the target is
        config.update(model=model_path)
    elif quant_type is not None:  # EAGLE: its head quantized only when asked
        config.update(model=model_path, quantization=quant_type)
    else:
        config.update(model=model_path)
    return SpeculativeConfig.parse(config)
