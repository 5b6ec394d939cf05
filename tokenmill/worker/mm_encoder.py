"""An image-text model's image side (vLLM's encoder runner and encoder cache): rank 0's
vision encoder turns a request's images into rows once, when a step first reaches their
placeholders (the images a step reaches, of all its requests, in one pass); the rows are
kept while the request runs (its later prompt chunks, and a recompute after preemption,
reuse them). Each step that computes placeholder rows (`StepInputs.image_rows`) starts its
first layer from its tokens' embeddings with the images' rows in their place
(`inputs_embeds`); the other tensor-parallel ranks of the first stage get those rows from
rank 0."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.scheduler import ScheduledRequest


class ImageEncoder:
    """Rank 0's: the vision encoder and each running request's images' rows."""

    def __init__(self, model_path: str, multimodal, device: torch.device,
                 dtype: torch.dtype) -> None:
        """`multimodal`: the model's MultiModalConfig (an mmproj file's tensors, where it
        names one)."""
        from tokenmill.loading.checkpoint import load_vision_encoder

        self.vision = load_vision_encoder(model_path, dtype, device, multimodal.mmproj)
        self.device, self.dtype = device, dtype
        self.rows: dict[str, list[torch.Tensor]] = {}  # request id -> each image's rows

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)

    def _encode(self, wanted: list[tuple]) -> None:
        """Encode the (request, image index) pairs `wanted` whose rows are not kept yet,
        every request's in one pass through the encoder."""
        missing = []
        for request, k in wanted:
            rows = self.rows.setdefault(request.request_id, [None] * len(request.mm_inputs))
            if rows[k] is None:
                missing.append((request, k))
        if not missing:
            return
        images = [(torch.from_numpy(np.frombuffer(m.pixels, dtype=np.float32)
                                    .reshape(m.shape).copy()).to(self.device, self.dtype),
                   m.size) for m in (request.mm_inputs[k] for request, k in missing)]
        with torch.inference_mode():
            encoded = self.vision.encode(images)
        for (request, k), value in zip(missing, encoded):
            self.rows[request.request_id][k] = value

    def step_rows(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """The rows of the step's image placeholders, in `StepInputs.image_rows`' order
        (sequences as `scheduled`, each one's images in prompt order); None: none. The
        images first reached in this step are encoded together, whatever their request."""
        spans = []
        for s in scheduled:
            for k, m in enumerate(s.request.mm_inputs):
                a, b = max(s.start, m.offset), min(s.end, m.end)
                if a < b:
                    spans.append((s.request, k, a - m.offset, b - m.offset))
        if not spans:
            return None
        self._encode([(request, k) for request, k, _, _ in spans])
        return torch.cat([self.rows[request.request_id][k][a:b]
                          for request, k, a, b in spans])


def inputs_embeds(model, tp, input_ids: torch.Tensor, rows: list[int],
                  values: torch.Tensor | None) -> torch.Tensor:
    """A step's first-layer input: its tokens' embeddings, the image rows (`values`: rank
    0's; None on the other ranks, which receive them) at `rows`."""
    embeds = model.model.embed_input(input_ids)
    if values is None:
        values = torch.empty(len(rows), embeds.shape[-1], dtype=embeds.dtype,
                             device=embeds.device)
    values = tp.broadcast(values.to(embeds.dtype).contiguous())
    embeds[torch.tensor(rows, device=embeds.device)] = values
    return embeds
