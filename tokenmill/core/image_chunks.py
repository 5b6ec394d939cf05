"""How far a prompt chunk reaching images may run: the vision encoder's rows a step (vLLM's
`max_num_encoder_input_tokens`) and, for a model whose image rows attend to each other both
ways (Gemma 3), never through the middle of an image."""

from __future__ import annotations

from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.core.request import Request


def image_chunk(request: Request, start: int, num_new: int, budget: int,
                config: SchedulerConfig) -> tuple[int, int, int]:
    """(the tokens of a chunk from `start` the encoder's `budget` left lets run, the image
    rows it encodes, the request's images encoded once it ran): the chunk stops before the
    first image past the budget; one image fits a step that encodes none. With
    `config.whole_images`, a chunk ends before an image it would cut, or (starting in or at
    one) at its end, past the token budget if need be."""
    spent, end, encoded = 0, start + num_new, request.num_encoded_images
    idle = budget == config.encoder_budget
    for image in request.mm_inputs[encoded:]:
        if image.offset >= end:
            break
        if config.whole_images and image.end > end:
            if image.offset > start:
                end = image.offset
                break
            end = image.end
        if image.end > start:  # (one a prefix-cache hit covers needs no encoding)
            if spent + image.length > budget and (spent or not idle):
                end = image.offset
                break
            spent += image.length
        encoded += 1
    return end - start, spent, encoded
