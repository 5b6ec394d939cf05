"""State layers (layers/state_layer.py): the chunked scans against their token-at-a-time
references, the causal convolution in pieces against one pass, and a layer's prompt in
chunks (its state carried in a slot from step to step) against the prompt in one step."""

import pytest
import torch
from transformers import Mamba2Config, Qwen3NextConfig

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.layers.gated_delta_net import (
    GatedDeltaNet,
    gated_delta_chunked,
    gated_delta_reference,
    l2_normalized,
)
from tokenmill.layers.mamba2 import Mamba2Mixer, ssd_chunked, ssd_reference
from tokenmill.layers.state_layer import causal_conv, causal_conv_step
from tokenmill.worker.state_cache import bind_state_cache, bytes_per_slot


@pytest.mark.parametrize("length,chunk", [(1, 8), (7, 8), (8, 8), (29, 8), (64, 16)])
@pytest.mark.parametrize("start", ["zeros", "carried"])
def test_ssd_in_chunks_equals_a_token_at_a_time(length, chunk, start):
    gen = torch.Generator().manual_seed(length)
    heads, p, n = 4, 8, 16
    x = torch.randn(length, heads, p, generator=gen)
    dt = torch.rand(length, heads, generator=gen) * 0.5
    A = -torch.rand(heads, generator=gen) * 4
    B, C = (torch.randn(length, heads, n, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    state = (torch.zeros(heads, p, n) if start == "zeros"
             else torch.randn(heads, p, n, generator=gen))
    ref_y, ref_state = ssd_reference(state, x, dt, A, B, C, D)
    y, final = ssd_chunked(state, x, dt, A, B, C, D, chunk)
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 4), (16, 4), (70, 64), (130, 64)])
@pytest.mark.parametrize("start", ["zeros", "carried"])
def test_gated_delta_rule_in_chunks_equals_a_token_at_a_time(length, chunk, start):
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 16, 8
    q, k = (l2_normalized(torch.randn(length, heads, dk, generator=gen)) for _ in range(2))
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 2
    beta = torch.rand(length, heads, generator=gen)
    state = (torch.zeros(heads, dk, dv) if start == "zeros"
             else torch.randn(heads, dk, dv, generator=gen))
    ref_out, ref_state = gated_delta_reference(state, q * dk ** -0.5, k, v, g, beta)
    out, final = gated_delta_chunked(state, q * dk ** -0.5, k, v, g, beta, chunk)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=1e-4, rtol=1e-4)


def test_causal_convolution_in_pieces_and_steps_equals_one_pass():
    gen = torch.Generator().manual_seed(0)
    channels, kernel, length = 6, 4, 11
    x = torch.randn(length, channels, generator=gen)
    weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels)
    whole, state = causal_conv(x, weight, bias, torch.zeros(channels, kernel - 1))
    # transformers' formula: zero-padded depthwise conv1d, first `length` outputs, SiLU
    ref = torch.nn.functional.conv1d(x.t()[None], weight[:, None], bias, padding=kernel - 1,
                                     groups=channels)[0, :, :length].t()
    torch.testing.assert_close(whole, torch.nn.functional.silu(ref))
    pieces, carried = [], torch.zeros(channels, kernel - 1)
    for lo, hi in ((0, 2), (2, 7), (7, 9)):
        y, carried = causal_conv(x[lo:hi], weight, bias, carried)
        pieces.append(y)
    for i in range(9, length):  # then one token at a time
        y, stepped = causal_conv_step(x[i:i + 1], weight, bias, carried[None])
        carried = stepped[0]
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), whole)
    torch.testing.assert_close(carried, state)


def _mamba2():
    config = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2,
                          chunk_size=4, num_hidden_layers=1, vocab_size=16)
    return Mamba2Mixer(config)


def _delta_net():
    config = Qwen3NextConfig(hidden_size=32, num_hidden_layers=1, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, vocab_size=16)
    return GatedDeltaNet(config)


def _meta(seqs, slots):
    """Metadata of a step over (context, new tokens) sequences holding state `slots`."""
    loc = [0]
    for _, q in seqs:
        loc.append(loc[-1] + q)
    decodes = 0
    while decodes < len(seqs) and seqs[decodes][1] == 1:
        decodes += 1
    return AttentionMetadata(
        slot_mapping=torch.zeros(loc[-1], dtype=torch.int64), query_start_loc=loc,
        context_lens=[c for c, _ in seqs], seq_lens=torch.tensor([c + q for c, q in seqs]),
        block_table=torch.zeros(len(seqs), 1, dtype=torch.int64), num_decodes=decodes,
        block_size=16, state_slots=torch.tensor(slots))


@pytest.mark.parametrize("make", [_mamba2, _delta_net], ids=["mamba2", "gated_delta_net"])
def test_a_prompt_in_chunks_beside_other_sequences_equals_it_in_one_step(make):
    """Sequence A's prompt in one step, and in chunks (then decodes) beside sequence B whose
    slot holds other state: A's outputs and final state agree; B's slot is its own. A slot
    reused from an earlier request starts from zeros (A's first chunk has no context)."""
    torch.manual_seed(0)
    layer = make()
    for param in layer.parameters():
        param.data = torch.randn_like(param) * 0.3
    layer.A_log.data = torch.randn_like(layer.A_log) * 0.3
    hidden = 32
    x = torch.randn(13, hidden)
    bind_state_cache([layer], 3, torch.float32, torch.device("cpu"))
    assert bytes_per_slot([layer], torch.float32) == 4 * sum(
        t[0].numel() for t in (layer.conv_state, layer.ssm_state))
    whole = layer.mix(x, _meta([(0, 13)], [1]))
    conv_whole, ssm_whole = layer.conv_state[1].clone(), layer.ssm_state[1].clone()
    layer.conv_state.normal_()  # (what earlier requests left in the slots)
    layer.ssm_state.normal_()
    other = torch.randn(1, hidden)
    pieces = [layer.mix(torch.cat([x[:5], other]), _meta([(0, 5), (0, 1)], [2, 0]))[:5]]
    b_conv, b_ssm = layer.conv_state[0].clone(), layer.ssm_state[0].clone()
    # B decodes first, then A's next chunk (num_decodes = 1 with B ahead)
    out = layer.mix(torch.cat([other, x[5:11]]), _meta([(1, 1), (5, 6)], [0, 2]))
    pieces.append(out[1:])
    assert not torch.equal(layer.conv_state[0], b_conv)  # (B's slot moved on: its own)
    assert not torch.equal(layer.ssm_state[0], b_ssm)
    for i in (11, 12):  # A's last two tokens as decodes
        pieces.append(layer.mix(x[i:i + 1], _meta([(i, 1)], [2])))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.conv_state[2], conv_whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.ssm_state[2], ssm_whole, atol=1e-4, rtol=1e-4)


def test_a_throwaway_step_without_slots_starts_from_zeros():
    """The profiling step: no slots; the outputs are a fresh prompt's, nothing is stored."""
    torch.manual_seed(0)
    layer = _mamba2()
    for param in layer.parameters():
        param.data = torch.randn_like(param) * 0.3
    x = torch.randn(6, 32)
    bind_state_cache([layer], 2, torch.float32, torch.device("cpu"))
    fresh = layer.mix(x, _meta([(0, 6)], [0]))
    layer.conv_state.zero_()
    layer.ssm_state.zero_()
    meta = _meta([(0, 6)], [0])
    meta.state_slots = None
    torch.testing.assert_close(layer.mix(x, meta), fresh)
    assert not layer.conv_state.any() and not layer.ssm_state.any()


@pytest.mark.parametrize("make", [_mamba2, _delta_net], ids=["mamba2", "gated_delta_net"])
@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_a_verified_sequence_resumes_from_the_row_after_its_last_accepted_draft(make,
                                                                               accepted):
    """A's decode with 3 drafts beside B's prompt chunk and C's decode with 1 draft (each
    slot 4 rows): the outputs are those of the rows one at a time, and A's next step, read
    from the row of its last accepted draft, equals A run over just the accepted rows."""
    torch.manual_seed(0)
    layer = make()
    for param in layer.parameters():
        param.data = torch.randn_like(param) * 0.3
    hidden, rows = 32, 4
    bind_state_cache([layer], 3 * rows, torch.float32, torch.device("cpu"))
    a, b, c = torch.randn(9, hidden), torch.randn(5, hidden), torch.randn(4, hidden)
    # A's context (5 rows) and C's (2 rows) as prompts: A in slot 2, C in slot 0, B in 1
    layer.mix(torch.cat([a[:5], c[:2]]), _meta([(0, 5), (0, 2)], [2 * rows, 0]))
    saved = layer.conv_state.clone(), layer.ssm_state.clone()
    meta = _meta([(5, 4), (0, 5), (2, 2)], [2 * rows, rows, 0])
    meta.state_drafts = [3, 0, 1]
    verified = layer.mix(torch.cat([a[5:9], b, c[2:4]]), meta)
    conv_after = layer.conv_state.clone(), layer.ssm_state.clone()
    # the same rows one step at a time from the saved states
    layer.conv_state.copy_(saved[0])
    layer.ssm_state.copy_(saved[1])
    one_by_one = [layer.mix(a[i:i + 1], _meta([(i, 1)], [2 * rows])) for i in range(5, 9)]
    torch.testing.assert_close(verified[:4], torch.cat(one_by_one), atol=1e-5, rtol=1e-5)
    layer.conv_state.copy_(conv_after[0])
    layer.ssm_state.copy_(conv_after[1])
    # A's next step resumes after its accepted drafts: its next token at position 6 + accepted
    nxt = torch.randn(1, hidden)
    meta = _meta([(6 + accepted, 1)], [2 * rows])
    meta.state_reads = torch.tensor([2 * rows + accepted])
    resumed = layer.mix(nxt, meta)
    layer.conv_state.copy_(saved[0])
    layer.ssm_state.copy_(saved[1])
    plain = layer.mix(torch.cat([a[5:6 + accepted], nxt]),
                      _meta([(5, 2 + accepted)], [2 * rows]))
    torch.testing.assert_close(resumed, plain[-1:], atol=1e-4, rtol=1e-4)
