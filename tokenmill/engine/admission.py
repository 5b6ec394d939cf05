"""What a request must satisfy to enter an engine core: a prompt within the context, token
ids within the vocabulary, a KV cache that can hold it, and a pooling model's requests
pooling (a generating model's generating); how long it may wait for its first step, and its
refusal when it waited that long (429 on every route)."""

from __future__ import annotations

import math

from tokenmill.config.multimodal import MultiModalConfig
from tokenmill.config.pooling import PoolerConfig
from tokenmill.core.limits import context_overflow, token_out_of_range
from tokenmill.core.request import FinishReason, Request
from tokenmill.engine.protocol import EngineCoreOutput, EngineCoreRequest


def check_request(request: EngineCoreRequest, max_model_len: int, vocab: int,
                  num_blocks: int, block_size: int, lookahead: int = 0,
                  pooler: PoolerConfig | None = None,
                  multimodal: MultiModalConfig | None = None) -> None:
    """Admission checks of an engine core (ValueError: refused, with the reason);
    `lookahead`: KV slots a proposer uses past the request's tokens; `pooler`: a pooling
    model's (its requests pool their prompt, generating nothing); `multimodal`: an
    image-text model's (its requests' images)."""
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
    check_images(request, multimodal)
    longest = min(n_prompt + (0 if pooling else params.max_tokens or max_model_len),
                  max_model_len) + lookahead
    if -(-longest // block_size) > num_blocks:
        raise ValueError(f"The request needs up to {longest} tokens of KV cache, more than "
                         f"the whole cache holds ({num_blocks} blocks of {block_size}).")


def check_images(request: EngineCoreRequest, multimodal: MultiModalConfig | None) -> None:
    """A request's images against the model's rules: each one's placeholder tokens in the
    prompt, in order and apart, as many as its rows; no image token without an image;
    pixels of the processor's size (a wrong one would fail the whole step)."""
    images, ids = request.mm_inputs, request.prompt_token_ids
    if multimodal is None:
        if images:
            raise ValueError("This model takes no images.")
        return
    if len(images) > multimodal.max_images:
        raise ValueError(f"A request may hold at most {multimodal.max_images} images "
                         f"(--limit-mm-per-prompt), got {len(images)}.")
    token, end = multimodal.image_token_id, 0
    for image in images:
        shape, rows = expected_shape(image, multimodal)
        if image.shape != shape or len(image.pixels) != 4 * math.prod(shape):
            raise ValueError(f"An image's pixels must be {' x '.join(map(str, shape))} "
                             "float32 values.")
        if (image.offset < end or image.length != rows
                or image.end > len(ids)
                or ids[image.offset:image.end] != [token] * image.length):
            raise ValueError("An image's placeholder tokens do not match the prompt.")
        end = image.end
    if ids.count(token) != sum(image.length for image in images):
        raise ValueError("The prompt has image tokens without an image.")


def expected_shape(image, multimodal: MultiModalConfig) -> tuple[list[int], int]:
    """The pixels' shape an image must have under the model's rules, and its rows."""
    side = multimodal.image_size
    if multimodal.dynamic:  # (its patch grid decides both; its rows' grid must match it)
        m = multimodal.merge_size
        if (len(image.size) != 3 or image.size[0] != 1
                or not all(0 < n <= 1 << 14 and n % m == 0 for n in image.size[1:])):
            raise ValueError(f"An image needs its grid of patches (1, rows, columns), each a "
                             f"multiple of {m}.")
        t, h, w = image.size
        if image.grid != [t, h // m, w // m]:
            raise ValueError("An image's rotary grid does not match its patches.")
        return [t * h * w, multimodal.patch_dim], t * h * w // (m * m)
    if image.grid:
        raise ValueError("This model's images have no rotary grid.")
    if multimodal.tiled:
        if len(image.size) != 2 or not all(0 < n <= 1 << 16 for n in image.size):
            raise ValueError("A tiled image needs its (height, width).")
        if multimodal.max_tiles and image.shape[:1] == [1]:  # (OneVision: one of several)
            return [1, 3, side, side], multimodal.untiled_rows
        return ([multimodal.tiles(*image.size), 3, side, side],
                multimodal.rows(*image.size))
    return [3, side, side], multimodal.tokens_per_image


def queue_limit(request: EngineCoreRequest, default: float | None) -> float | None:
    """The seconds `request` may wait for its first step: its own `max_queue_time` (0: none)
    within the engine's --max-queue-time; None: no limit."""
    own = request.max_queue_time
    if not math.isfinite(own) or own < 0:
        raise ValueError(f"max_queue_time must be a number of seconds > 0, got {own!r}.")
    limits = [limit for limit in (own, default) if limit]
    return min(limits) if limits else None


def late_refusal(request: Request) -> EngineCoreOutput:
    """The answer to a request that waited its whole `max_queue_time` without starting."""
    seconds = request.max_queue_time or 0.0
    return EngineCoreOutput(
        request.request_id, [], int(FinishReason.ABORT), retry_after=max(1, math.ceil(seconds)),
        error=f"The server is overloaded: the request waited {seconds:g} s (its "
              "max_queue_time) without starting. Retry later.")
