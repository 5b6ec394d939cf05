"""Speculative decoding's parts on their own: the n-gram proposer against a slow per-position
search, the configuration's checks, and the rejection sampler: greedy verification equals
one-token-at-a-time argmax decoding, sampled verification keeps the target's distribution
(chi-square over many seeded draws)."""

import itertools
import random

import numpy as np
import pytest
import torch

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.sample.rejection_sampler import verify_greedy, verify_sampled
from tokenmill.spec_decode import ngram


def test_ngram_finds_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0: propose what followed it there
    assert ngram.propose(tokens, 3, 1, 3) == [4, 9, 2]
    # only 2-grams: [2, 3] last occurred at 5 (before the suffix itself): 7 then 1 ...
    assert ngram.propose(tokens, 2, 1, 2) == [7, 1]
    assert ngram.propose([5, 6, 7], 4, 1, 3) == []  # no earlier occurrence of any suffix
    assert ngram.propose([4, 4], 3, 1, 1) == [4]  # what followed, up to the context's end


@pytest.mark.parametrize("seed", range(40))
def test_ngram_matches_the_slow_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    k, low = rng.randrange(1, 6), rng.randrange(1, 4)
    high = low + rng.randrange(0, 4)
    assert ngram.propose(tokens, k, low, high) == ngram.propose_slow(tokens, k, low, high)


@pytest.mark.parametrize("seed", range(20))
def test_ngram_matches_the_slow_search_on_long_contexts(seed):
    """Longer contexts over small and large vocabularies (many or few candidate places),
    given as arrays as the proposer holds them."""
    rng = random.Random(100 + seed)
    vocab = rng.choice([2, 5, 50, 5000])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 3000))]
    for _ in range(5):
        k, low = rng.randrange(1, 8), rng.randrange(1, 5)
        high = low + rng.randrange(0, 4)
        assert ngram.propose(np.array(tokens), k, low, high) == \
            ngram.propose_slow(tokens, k, low, high)


def test_ngram_context_follows_the_request_tokens():
    """The proposer's array of a request's tokens, extended step by step (prompt growing
    past its capacity, several tokens a step, a request whose tokens are not what the array
    holds), always equals the token lists."""
    rng = random.Random(5)
    context = ngram.Context()
    for _ in range(30):
        prompt = [rng.randrange(100) for _ in range(rng.randrange(0, 600))]
        output: list[int] = []
        for _ in range(rng.randrange(1, 40)):
            output += [rng.randrange(100) for _ in range(rng.randrange(0, 40))]
            got = context.update(prompt, output)
            assert got.tolist() == prompt + output


def _running_ngram(count: int, **config):
    """An n-gram proposer (2 drafts, 1-grams up) and `count` running requests."""
    from tokenmill.core.request import Request, RequestStatus
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.spec_decode.proposer import NgramProposer

    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_min": 1, **config})
    requests = [Request(f"r{i}", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10))
                for i in range(count)]
    for r in requests:
        r.status = RequestStatus.RUNNING
    return NgramProposer(config, max_model_len=100), requests


def test_ngram_proposer_keeps_contexts_only_of_running_requests():
    from tokenmill.core.request import RequestStatus

    proposer, requests = _running_ngram(2)
    proposer.propose(requests, num_running=2)
    assert sorted(proposer.contexts) == ["r0", "r1"]
    requests[0].status = RequestStatus.FINISHED_STOPPED
    proposer.propose(requests, num_running=1)
    assert sorted(proposer.contexts) == ["r1"]
    proposer.release(["r1"])
    assert proposer.contexts == {}


def test_ngram_padding_fills_lookups_up_to_k_and_counts_only_its_fillers():
    proposer, (request,) = _running_ngram(1)
    proposer.pad = True
    request.prompt_token_ids = [1, 2, 3, 4, 5]  # no earlier n-gram: no lookup at all
    proposer.propose([request], num_running=1)
    assert (request.spec_token_ids, request.spec_padding) == ([5, 5], 2)
    request.output_token_ids.append(3)  # "3" came before, followed by 4, 5
    proposer.propose([request], num_running=1)  # (the scheduler did not clear it here)
    assert (request.spec_token_ids, request.spec_padding) == ([4, 5], 0)
    proposer.pad = False  # (engines without drafted buckets)
    request.output_token_ids.append(9)
    proposer.propose([request], num_running=1)
    assert (request.spec_token_ids, request.spec_padding) == ([], 0)


def test_config_defaults_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse({"model": "m", "num_speculative_tokens": 2}).method == \
        "draft_model"
    c = SpeculativeConfig.parse({"quantization": "wint4", "num_speculative_tokens": 2})
    assert (c.method, c.model, c.quantization) == ("draft_model", None, "int4")  # self-draft
    # switched off above the measured batch sizes unless told otherwise
    assert c.disable_by_batch_size == 2
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).disable_by_batch_size == 8
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2,
                                    "disable_by_batch_size": 100}).disable_by_batch_size == 100
    for empty in (None, "", " ", {}):
        assert SpeculativeConfig.parse(empty) is None
    bad = [("{", "not valid JSON"), ("[1]", "JSON object"),
           ({"method": "ngram"}, "needs num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
           ({"method": "ngram", "num_speculative_tokens": True}, "positive integer"),
           ({"method": "medusa", "num_speculative_tokens": 2}, "Unknown speculative method"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft"),
           ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int3"},
            "quantization must be one of"),
           ({"method": "eagle", "num_speculative_tokens": 2}, "needs a draft model"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2}, "larger than prompt_lookup_max"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be"),
           ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
            "unknown field"),
           ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(value)


def test_greedy_verification_is_one_token_at_a_time_decoding():
    # the target's argmax after each prefix; drafts agree for two tokens, then not
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6], [4]) == [5]
    assert verify_greedy([3], []) == [3]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of the chi-square distribution with 5 degrees of freedom
CHI2_5_999 = 20.515


@pytest.mark.parametrize("one_hot", [False, True])
def test_sampled_verification_keeps_the_target_distribution(one_hot):
    """Target rows p_0, p_1, p_2 fixed (conditionals that don't depend on the prefix), drafts
    from q (or, like n-gram lookup, a fixed token): every emitted position j is distributed
    as p_j."""
    vocab, k, trials = 6, 2, 6000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    counts = torch.zeros(k + 1, vocab)
    accepted = 0
    for _ in range(trials):
        drafts = [1, 4] if one_hot else [int(torch.multinomial(q[j], 1, generator=g))
                                         for j in range(k)]
        out = verify_sampled(p, drafts, None if one_hot else q, g)
        assert 1 <= len(out) <= k + 1 and out[:len(out) - 1] == drafts[:len(out) - 1]
        accepted += len(out) - 1
        for j, token in enumerate(out):
            counts[j, token] += 1
    for j in range(k + 1):
        assert _chi_square(counts[j], p[j]) < CHI2_5_999, j
    assert 0 < accepted < trials * k  # both outcomes happened


def test_seeded_verification_reproduces():
    p = torch.softmax(torch.randn(4, 50), dim=-1)
    runs = [verify_sampled(p, [3, 7, 9], None, torch.Generator().manual_seed(11))
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_flag_and_the_seeds_variables():
    from tokenmill.config.server import build_server_config

    env = {"SPECULATE_METHOD": "inference_with_reference", "SPECULATE_MAX_DRAFT_TOKEN_NUM": "4",
           "SPECULATE_MAX_NGRAM_SIZE": "3"}
    c = build_server_config(["m"], env).engine.speculative_config
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == \
        ("ngram", 4, 1, 3)
    flag = build_server_config(["m", "--speculative-config", '{"num_speculative_tokens": 2}'],
                               env).engine.speculative_config  # the flag wins
    assert (flag.num_speculative_tokens, flag.prompt_lookup_max) == (2, 5)
    assert build_server_config(["m"], {"SPECULATE_METHOD": "None"}).engine.speculative_config \
        is None
    for method, message in (("mtp", "SPECULATE_MODEL_PATH"), ("lookahead", "SPECULATE_METHOD")):
        with pytest.raises(ValueError, match=message):
            build_server_config(["m"], {"SPECULATE_METHOD": method})
    with pytest.raises(ValueError, match="not valid JSON"):
        build_server_config(["m", "--speculative-config", "{ngram}"], {})
    c = build_server_config(["m"], {"SPECULATE_METHOD": "mtp", "SPECULATE_MODEL_PATH": "m"}
                            ).engine.speculative_config
    assert (c.method, c.model, c.quantization, c.num_speculative_tokens) == ("mtp", "m", None, 5)
    c = build_server_config(["m"], {"SPECULATE_METHOD": "eagle", "SPECULATE_MODEL_PATH": "e",
                                    "SPECULATE_MODEL_QUANT_TYPE": "weight_only_int8"}
                            ).engine.speculative_config
    assert (c.method, c.model, c.quantization) == ("eagle", "e", "int8")


def test_metrics_from_the_cores_cumulative_counts():
    from prometheus_client import generate_latest

    from tokenmill.engine.protocol import SchedulerStats
    from tokenmill.metrics import Metrics

    metrics = Metrics("tiny", 8)
    for drafts, accepted, emitted, steps in ((6, 3, 5, 2), (10, 4, 8, 4)):
        metrics.observe_stats(SchedulerStats(spec_draft_tokens=drafts, spec_accepted_tokens=
                                             accepted, spec_emitted_tokens=emitted,
                                             spec_steps=steps))
    metrics.observe_stats(SchedulerStats(spec_draft_tokens=2, spec_accepted_tokens=1,
                                         spec_emitted_tokens=2, spec_steps=1), engine=1)
    text = generate_latest(metrics.registry).decode()

    def value(name, engine="0"):
        line = next(x for x in text.splitlines() if x.startswith(name + "{")
                    and f'engine="{engine}"' in x)
        return float(line.rsplit(" ", 1)[1])

    # counters: the latest cumulative counts, per replica
    assert value("tokenmill:spec_decode_num_draft_tokens_total") == 10
    assert value("tokenmill:spec_decode_num_accepted_tokens_total") == 4
    assert value("tokenmill:spec_decode_num_emitted_tokens_total") == 8
    assert value("tokenmill:spec_decode_num_draft_tokens_total", "1") == 2
    assert value("tokenmill:spec_decode_draft_acceptance_rate") == 0.4
    assert value("tokenmill:spec_decode_mean_accepted_length") == 2.0


def test_proposals_stop_above_disable_by_batch_size():
    proposer, requests = _running_ngram(3, disable_by_batch_size=2)
    proposer.propose(requests, num_running=3)
    assert all(r.spec_token_ids == [] for r in requests)
    proposer.propose(requests, num_running=2)
    assert all(r.spec_token_ids == [3, 1] for r in requests)


def test_verified_rows_take_penalties_and_bans_of_their_own_context():
    """Row j of a drafted step is scored as decoding would score it after drafts 1 .. j:
    repetition / frequency penalties over them, min_tokens bans until the output is long
    enough (here: the raw argmax differs at every row, and a batch built from the request
    alone rejects draft 2)."""
    import dataclasses

    from tokenmill.core.request import Request, RequestStatus
    from tokenmill.sample.rejection_sampler import verify
    from tokenmill.sample.request_sampling import RequestSampling
    from tokenmill.sample.sampler import sample
    from tokenmill.sampling_params import SamplingParams

    sampling = RequestSampling(12, torch.device("cpu"))
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                            min_tokens=4, stop_token_ids=[5], max_tokens=10)
    request = Request("r", [1, 2, 3], params, output_token_ids=[4],
                      status=RequestStatus.RUNNING)
    logits = torch.zeros(4, 12)
    logits[0, 4], logits[0, 6] = 3.0, 2.5  # 4 was output: penalized below 6
    logits[1, 6], logits[1, 7] = 3.0, 2.0  # 6 (draft 1) now penalized below 7
    logits[2, 5], logits[2, 8] = 5.0, 1.0  # 3 tokens out: stop token 5 still banned
    logits[3, 5] = 5.0  # 4 tokens out: allowed
    drafts = [6, 7, 8]
    emitted = verify(logits.clone(), sampling.drafted_batch(request, drafts), drafts, None)
    expected = []
    for j in range(4):  # the slow way: one row at a time, the output growing
        view = dataclasses.replace(request, output_token_ids=[4] + drafts[:j])
        token = int(sample(logits[j:j + 1].clone(), sampling.batch([view])).token_ids[0])
        expected.append(token)
        if j == 3 or token != drafts[j]:
            break
    assert emitted == expected == [6, 7, 8, 5]
    assert verify(logits.clone(), sampling.batch([request] * 4), drafts, None) == [6, 6]


def test_verify_many_equals_verify_request_by_request():
    """A step's drafted requests verified together (greedy ones without penalties from one
    argmax over their rows) emit what `verify` gives each one alone: greedy plain, greedy
    with a logit bias and a min_tokens ban (adjusted in place), greedy with a repetition
    penalty (adjusted apart), and seeded sampling, in an interleaved order."""
    from tokenmill.core.request import Request, RequestStatus
    from tokenmill.sample.rejection_sampler import verify, verify_many
    from tokenmill.sample.request_sampling import RequestSampling
    from tokenmill.sampling_params import SamplingParams

    vocab = 40
    sampling = RequestSampling(vocab, torch.device("cpu"))
    kinds = [dict(temperature=0), dict(temperature=0, logit_bias={3: 4.0}, min_tokens=9,
                                       stop_token_ids=[7]),
             dict(temperature=0.8, seed=5), dict(temperature=0, repetition_penalty=1.5),
             dict(temperature=0)]
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, **kind),
                        output_token_ids=[4, 7], status=RequestStatus.RUNNING)
                for i, kind in enumerate(kinds)]
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        counts = [random.Random(trial * 7 + i).randint(1, 4) for i in range(len(requests))]
        logits = torch.randn(sum(counts), vocab, generator=gen) * 3
        ends = list(itertools.accumulate(counts))
        spans = [(end - n, end) for end, n in zip(ends, counts)]
        drafts = []
        for a, b in spans:  # drafts that agree with the argmax for a while, then not
            agree = logits[a:b - 1].argmax(-1).tolist()
            drafts.append(agree[:trial % 3] + [(t + 1) % vocab for t in agree[trial % 3:]])
        batches = [sampling.drafted_batch(r, d) for r, d in zip(requests, drafts)]
        probs = [None] * len(requests)
        seeded = sampling.generator(requests[2])
        state = seeded.get_state()
        got = verify_many(logits.clone(), spans, batches, drafts,
                          [sampling.generator(r) for r in requests], probs)
        seeded.set_state(state)
        want = [verify(logits[a:b].clone(), sampling.drafted_batch(r, d), d,
                       sampling.generator(r), None)
                for (a, b), r, d in zip(spans, requests, drafts)]
        assert got == want
