"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar, through xgrammar (params.py: what a request asks for;
backend.py: compiling it; manager.py: the engine core's compile queue and the per-request
matchers that mask each constrained row's logits)."""

from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
