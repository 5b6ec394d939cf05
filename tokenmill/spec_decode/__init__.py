"""Speculative decoding: cheap proposers guess the next k tokens of a request, one target
forward scores all k + 1 positions, and a rejection sampler keeps the guesses the target
agrees with (exactly the target's tokens under greedy, the target's distribution when
sampling) plus one token of its own.

- `make_proposer` (here): the proposer of the configured method.
- `proposer.py`: the budget and who speculates; n-gram and draft-head proposers.
- `draft_model.py`: a draft model run by its own model runner.
- `SpeculativeConfig` (vLLM's `--speculative-config` fields, validated) is config/speculative.py's.
- `ngram.py`: prompt lookup (vLLM's "ngram" method, the seed's `inference_with_reference`):
  the tokens that followed the latest earlier occurrence of the context's last n tokens.
- The rejection sampler that verifies drafts against the target's scores is
  sample/rejection_sampler.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.config.model import ModelConfig
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.spec_decode.proposer import HeadProposer, NgramProposer, Proposer


def make_proposer(config: SpeculativeConfig, engine_config, target: ModelConfig,
                  num_blocks: int, make_runner: Callable[..., Any]) -> Proposer:
    """The proposer of `config.method` for the `target` model (a draft model: loaded here
    by `make_runner`, the engine's model runner class, its KV cache holding as many tokens
    as the target's, `num_blocks`)."""
    max_model_len = target.max_model_len
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    if config.method == "draft_model":
        from tokenmill.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, engine_config, target, num_blocks, make_runner)
    if config.method in ("eagle", "eagle3"):
        return HeadProposer(config, max_model_len)  # (the head loaded by the runner)
    if config.method == "mtp":
        import os

        from tokenmill.loading.checkpoint import resolve_model_path
        if config.model and (os.path.realpath(resolve_model_path(config.model))
                             != os.path.realpath(target.path)):
            raise ValueError("Speculative method 'mtp' runs the target's own MTP layers: "
                             "\"model\" (SPECULATE_MODEL_PATH) must be the target's path or "
                             "left out; MTP layers from a separate checkpoint are not read.")
        return HeadProposer(config, max_model_len)  # (its layers checked by the runner)
    raise ValueError(f"Speculative method {config.method!r} is not served yet; \"ngram\", "
                     "\"draft_model\", \"mtp\" and \"eagle\" are.")
