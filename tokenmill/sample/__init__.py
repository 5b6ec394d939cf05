"""Sampling a step's logits: request_sampling.py (each request's parameters and tokens as one
`SamplingBatch`, seeded generators), sampler.py (penalties, top-k/top-p/min-p, the draw,
logprobs), grammar_mask.py (structured outputs' masks) and rejection_sampler.py (draft tokens
verified against the target's scores)."""
