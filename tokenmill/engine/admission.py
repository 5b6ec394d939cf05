"""What a request must satisfy to enter an engine core: a prompt within the context, token
ids within the vocabulary, a KV cache that can hold it, and a pooling model's requests
pooling (a generating model's generating)."""

from __future__ import annotations

from tokenmill.config.pooling import PoolerConfig
from tokenmill.core.limits import context_overflow, token_out_of_range
from tokenmill.engine.protocol import EngineCoreRequest


def check_request(request: EngineCoreRequest, max_model_len: int, vocab: int,
                  num_blocks: int, block_size: int, lookahead: int = 0,
                  pooler: PoolerConfig | None = None) -> None:
    """Admission checks of an engine core (ValueError: refused, with the reason);
    `lookahead`: KV slots a proposer uses past the request's tokens; `pooler`: a pooling
    model's (its requests pool their prompt, generating nothing)."""
    n_prompt = len(request.prompt_token_ids)
    if n_prompt == 0:
        raise ValueError("The prompt is empty.")
    pooling = request.pooling_params
    if (pooler is None) != (pooling is None):
        raise ValueError("This model generates text: it pools nothing." if pooler is None else
                         "This model is served for pooling (--runner pooling): it generates "
                         "no text.")
    if pooling is not None:
        pooler.check(pooling)
        if n_prompt > max_model_len:
            raise ValueError(f"The input has {n_prompt} tokens, more than max_model_len "
                             f"({max_model_len}).")
    elif context_overflow(n_prompt, 1, max_model_len):
        raise ValueError(f"The prompt has {n_prompt} tokens, which leaves no room to "
                         f"generate within max_model_len ({max_model_len}).")
    params = request.sampling_params
    # Stop ids, logit_bias and allowed_token_ids index the logits row (min_tokens bans the
    # stop ids): out of range would fail the whole engine step, not just this request.
    for what, ids in (("Prompt token ids", request.prompt_token_ids),
                      ("stop_token_ids", params.stop_token_ids),
                      ("logit_bias token ids", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        refused = token_out_of_range(ids, vocab)
        if refused is not None:
            raise ValueError(refused.message(what))
    longest = min(n_prompt + (0 if pooling else params.max_tokens or max_model_len),
                  max_model_len) + lookahead
    if -(-longest // block_size) > num_blocks:
        raise ValueError(f"The request needs up to {longest} tokens of KV cache, more than "
                         f"the whole cache holds ({num_blocks} blocks of {block_size}).")
