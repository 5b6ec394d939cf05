"""tokenmill: an LLM serving engine with continuous batching over a paged KV cache."""

from typing import Any

from tokenmill.beam_search import BeamSearchParams
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so `import tokenmill.core` (pure Python) never pulls in torch.
    if name == "LLM":
        from tokenmill.entrypoints.offline import LLM
        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
