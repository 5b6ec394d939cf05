"""tokenmill: an LLM serving engine with continuous batching over a paged KV cache."""

from typing import Any

from tokenmill.config.env import huge_pages_for_torch

huge_pages_for_torch()  # (before anything imports torch)

from tokenmill.beam_search import BeamSearchParams  # noqa: E402
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so `import tokenmill.core` (pure Python) never pulls in torch.
    if name == "LLM":
        from tokenmill.entrypoints.offline import LLM
        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
