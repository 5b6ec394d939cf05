"""The shared token rules (core/limits.py) against the protocols' own statements of them: the
seed refuses input_ids_len + min_dec_len >= max_seq_len, Triton prompt + max_tokens >
context, OpenAI a prompt leaving no room or prompt + max_tokens > context."""

import itertools

from tokenmill.core.limits import context_overflow, token_out_of_range

L = 6


def test_the_length_rule_is_each_protocols_rule():
    for n_in, n in itertools.product(range(L + 3), range(L + 3)):
        refused = context_overflow(n_in, n, L)
        assert (refused is None) == (n_in < L and n_in + n <= L)
        if refused is not None:
            assert refused.no_room == (n_in >= L)
        # the seed's min_dec_len, as the native route asks (min_dec_len + 1 must fit)
        assert (context_overflow(n_in, n + 1, L) is not None) == (n_in + n >= L)
        if n >= 1:  # Triton's and OpenAI's max_tokens (at least 1)
            assert (context_overflow(n_in, n, L) is not None) == (n_in + n > L)


def test_the_token_range_rule_names_the_first_id_outside():
    assert token_out_of_range([0, 5, 9], 10) is None
    assert token_out_of_range([], 10) is None
    refused = token_out_of_range([3, 10, -1], 10)
    assert (refused.token, refused.vocab_size) == (10, 10)
    assert token_out_of_range(iter([2, -1]), 10).token == -1
    assert refused.message("Prompt token ids") == "Prompt token ids must be in [0, 10)."
