"""Per-request settings of a pooling model's request (vLLM's `PoolingParams`): what the
pooled vector becomes, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import InvalidParameter

POOLING_TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    """`task`: embed (the model's embedding) or classify (its classifier's scores).
    `dimensions`: an embedding's first this many values, renormalized when normalized
    (OpenAI's `dimensions`, Matryoshka truncation). `normalize`: unit length (None: as the
    model's sentence-transformers modules say). `use_activation`: classify scores through
    the sigmoid (one label) or softmax (several); False gives the raw logits."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidParameter("task", f"task must be one of {', '.join(POOLING_TASKS)}, "
                                   f"got {self.task!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidParameter("dimensions", "dimensions must be a positive integer, got "
                                   f"{self.dimensions!r}.")
