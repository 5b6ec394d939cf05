"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar, through xgrammar (what a request asks for is
`sampling_params.StructuredOutputsParams`; response_format.py: OpenAI's `response_format` as
one; backend.py: compiling it; manager.py: the engine core's compile queue and the
per-request matchers that mask each constrained row's logits)."""

from tokenmill.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
