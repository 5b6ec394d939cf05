"""Speculative decoding: cheap proposers guess the next k tokens of a request, one target
forward scores all k + 1 positions, and a rejection sampler keeps the guesses the target
agrees with (exactly the target's tokens under greedy, the target's distribution when
sampling) plus one token of its own.

- `config.py`: `SpeculativeConfig` (vLLM's `--speculative-config` fields, validated).
- `ngram.py`: prompt lookup (vLLM's "ngram" method, the seed's `inference_with_reference`):
  the tokens that followed the latest earlier occurrence of the context's last n tokens.
- `rejection.py`: verification of draft tokens against the target's scores, with the slow
  per-token formulas it follows stated beside it."""
