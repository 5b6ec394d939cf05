"""An image-text model's image side on rank 0 (vLLM's encoder runner and encoder cache):
the vision encoder turns a request's images into rows once, when a step first reaches their
placeholders; the rows are kept while the request runs (its later prompt chunks, and a
recompute after preemption, reuse them) and put in place of the placeholder tokens' rows
of each step that computes them (`inputs_embeds`: the language model starts from those)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.scheduler import ScheduledRequest

# (rows of the step holding image rows, those rows)
StepImages = tuple[torch.Tensor, torch.Tensor]


class ImageEncoder:
    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype) -> None:
        from tokenmill.loading.checkpoint import load_vision_encoder

        self.vision = load_vision_encoder(model_path, dtype, device)
        self.device, self.dtype = device, dtype
        self.rows: dict[str, list[torch.Tensor]] = {}  # request id -> each image's rows

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)

    def _encoded(self, request) -> list[torch.Tensor]:
        rows = self.rows.get(request.request_id)
        if rows is None:  # (all its images in one pass)
            pixels = torch.stack([torch.from_numpy(np.frombuffer(m.pixels, dtype=np.float32)
                                                   .reshape(m.shape).copy())
                                  for m in request.mm_inputs]).to(self.device, self.dtype)
            with torch.inference_mode():
                rows = list(self.vision(pixels))
            self.rows[request.request_id] = rows
        return rows

    def step_rows(self, scheduled: list[ScheduledRequest]) -> StepImages | None:
        """The image rows of a step (its sequences in `scheduled`'s order); None: none of
        its tokens is an image's."""
        index, values, first = [], [], 0
        for s in scheduled:
            for k, image in enumerate(s.request.mm_inputs):
                a, b = max(s.start, image.offset), min(s.end, image.end)
                if a < b:
                    rows = self._encoded(s.request)[k]
                    index.append(torch.arange(first + a - s.start, first + b - s.start))
                    values.append(rows[a - image.offset:b - image.offset])
            first += s.num_new_tokens
        if not index:
            return None
        return torch.cat(index).to(self.device), torch.cat(values)

    def inputs_embeds(self, model, input_ids: torch.Tensor, images: StepImages) -> torch.Tensor:
        """The step's first-layer input: its tokens' embeddings, image rows in place."""
        embeds = model.model.embed_input(input_ids)
        rows, values = images
        embeds[rows] = values.to(embeds.dtype)
        return embeds
