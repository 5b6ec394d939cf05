"""The engine's host-side work per step (what bounds a GPU's batch-1 decode): each shortcut
against the obvious computation it replaces."""

import random

import numpy as np
import pytest
import torch
from helpers import make_spm_tokenizer, make_tokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.core.request import Request
from tokenmill.sample.request_sampling import RequestSampling
from tokenmill.text_buffer import TextBuffer
from tokenmill.tokenizer import _UNSET, IncrementalDetokenizer, token_decoder
from tokenmill.worker.step_inputs import StepInputs


@pytest.mark.parametrize("make", [make_tokenizer, make_spm_tokenizer])
@pytest.mark.parametrize("skip", [True, False])
def test_token_decoder_equals_the_tokenizers_decode(tmp_path, make, skip):
    tokenizer = make(str(tmp_path))
    rng = random.Random(0)
    decode = token_decoder(tokenizer, skip)
    for n in [0, 1, 2, 5, 30]:  # special tokens and partial UTF-8 byte tokens included
        for _ in range(20):
            ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("make", [make_tokenizer, make_spm_tokenizer])
@pytest.mark.parametrize("skip", [True, False])
def test_streamed_detokenizer_equals_the_python_steps(tmp_path, make, skip):
    """The detokenizer through `tokenizers`' DecodeStream gives the reference steps' deltas,
    call by call: random ids (special tokens, partial UTF-8 byte tokens) in random chunks
    after random prompts (some ending in an incomplete character), flushed at the end."""
    tokenizer = make(str(tmp_path))
    tokenizer.clean_up_tokenization_spaces = False  # (decoded by the backend as it is)
    rng = random.Random(2)
    streamed = 0
    for _ in range(300):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 30))]
        fast = IncrementalDetokenizer(tokenizer, prompt, skip)
        reference = IncrementalDetokenizer(tokenizer, prompt, skip)
        reference._start_stream = lambda: None
        cuts = sorted(rng.sample(range(len(ids) + 1), min(3, len(ids) + 1)))
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        for i, chunk in enumerate(chunks):
            final = i == len(chunks) - 1
            streamed += final and fast._stream not in (None, _UNSET)  # (still streaming)
            assert fast.add_tokens(chunk, final) == reference.add_tokens(chunk, final)
        # the text kept in pieces: its length and any tail as the joined text's (read
        # before `text`, which joins the pieces)
        assert fast.text_length == len(reference.text)
        assert [fast.tail(k) for k in range(len(reference.text) + 2)] == [
            reference.text[k:] for k in range(len(reference.text) + 2)]
        assert fast.text == reference.text
    assert streamed > 100  # (most prompts' text ends in a whole character)


def test_token_decoder_keeps_the_wrappers_space_clean_up(tmp_path):
    tokenizer = make_tokenizer(str(tmp_path))
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer.encode("Paris , France . Tokens !", add_special_tokens=False)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    assert want != tokenizer._tokenizer.decode(ids)  # (the clean-up changed something)
    assert token_decoder(tokenizer)(ids) == want


def test_step_layout_equals_the_per_token_formula():
    rng = random.Random(1)
    bs = 4
    starts, ends, blocks = [], [], []
    for _ in range(30):
        start = rng.randrange(0, 30)
        # decodes and prompt chunks, within a block or across several
        end = start + rng.choice([1, 1, rng.randrange(1, 12), rng.randrange(1, 40)])
        starts.append(start)
        ends.append(end)
        blocks.append(rng.sample(range(100), -(-end // bs)))
    inputs = StepInputs([0] * sum(e - s for s, e in zip(starts, ends)), starts, ends, blocks,
                        [], [], [], [])
    positions, slots, table = inputs.layout(bs)
    want_pos = [p for s, e in zip(starts, ends) for p in range(s, e)]
    want_slots = [b[p // bs] * bs + p % bs for s, e, b in zip(starts, ends, blocks)
                  for p in range(s, e)]
    assert positions.tolist() == want_pos and slots.tolist() == want_slots  # (numpy)
    width = max(len(b) for b in blocks)
    assert table.dtype == np.int64
    assert table.tolist() == [b + [0] * (width - len(b)) for b in blocks]
    padded = inputs.layout(bs, rows=len(blocks) + 3)[2]  # (a graph bucket's padding rows)
    assert padded.tolist() == table.tolist() + [[0] * width] * 3
    # one token per sequence (the decodes' shortcut)
    decodes = StepInputs([0] * len(starts), starts, [s + 1 for s in starts], blocks,
                         [], [], [], [])
    positions, slots, _ = decodes.layout(bs)
    assert positions == starts  # (lists)
    assert slots == [b[p // bs] * bs + p % bs for p, b in zip(starts, blocks)]


@pytest.mark.parametrize("lengths", [[1, 1, 1], [3, 1, 2], [2048], [5, 2, 7]])
def test_step_inputs_staged_in_one_array(lengths):
    bs = 16
    starts = [7 * i for i in range(len(lengths))]
    ends = [s + n for s, n in zip(starts, lengths)]
    blocks = [list(range(100 * i, 100 * i + -(-e // bs))) for i, e in enumerate(ends)]
    token_ids = list(range(3, 3 + sum(lengths)))
    inputs = StepInputs(token_ids, starts, ends, blocks, [], [], [], [])
    packed, parts, table = inputs.staged(bs)
    positions, slots, want_table = inputs.layout(bs)
    assert [packed[p].tolist() for p in parts] == [
        token_ids, np.asarray(positions).tolist(), np.asarray(slots).tolist(), ends]
    assert all(p.start % 2 == 0 for p in parts)  # (16-byte aligned on the device)
    assert (table == want_table).all()


@pytest.mark.parametrize("temperatures", [[0.0, 0.0], [0.0, 0.7], [1.0]])
def test_all_greedy_known_on_the_host(temperatures):
    requests = [Request(f"r{i}", [3, 4], SamplingParams(temperature=t))
                for i, t in enumerate(temperatures)]
    batch = RequestSampling(64, torch.device("cpu")).batch(requests)
    assert batch.all_greedy == bool((batch.temperature == 0).all())
    assert batch.temperature.tolist() == pytest.approx(temperatures)


def test_final_only_steps_build_only_finished_results(tiny_models):
    llm = LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.05)
    engine = llm.engine
    engine.add_request("short", {"prompt_token_ids": [5, 6]},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("long", {"prompt_token_ids": [7, 8]},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        seen += [(out.request_id, out.finished) for out in engine.step(final_only=True)]
    assert seen == [("short", True), ("long", True)]
    cumulative = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)
    assert len(cumulative[1].outputs[0].token_ids) == 6


def test_offline_results_equal_the_serving_steps(tiny_models):
    # the offline LLM (final-only steps) gives the text and tokens the serving path's
    # per-step results end with: stop tokens trimmed or kept, n > 1, special tokens
    llm = LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.05)
    engine = llm.engine
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids[5]
    cases = [greedy, greedy.clone(stop_token_ids=[stop]),
             greedy.clone(stop_token_ids=[stop], include_stop_str_in_output=True),
             greedy.clone(skip_special_tokens=False),
             SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=12),
             greedy.clone(stop=["zz"])]

    def per_step(params):
        engine.add_request("r", prompt, params)
        last = None
        for _ in range(40):
            if not engine.has_unfinished_requests():
                break
            last = engine.step()[-1]
        return last

    tokenizer = engine.tokenizer
    for params in cases:
        want = per_step(params)
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [(c.text, c.token_ids, c.finish_reason) for c in got.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in want.outputs]
        assert got.outputs[0].text  # (something was decoded)
    assert want.outputs[0].text == tokenizer.decode(want.outputs[0].token_ids,
                                                    skip_special_tokens=True)


def test_sampling_batch_equals_the_per_request_settings():
    # a step's sampling columns and per-row extras (min_tokens bans, logit bias, seeded
    # generators) for a random mix of requests: against each request's own parameters
    rng = random.Random(3)
    options = [{}, {"temperature": 0.7}, {"top_p": 0.8, "temperature": 1.0}, {"top_k": 5},
               {"min_p": 0.1}, {"repetition_penalty": 1.2}, {"frequency_penalty": 0.5},
               {"presence_penalty": -0.3}, {"min_tokens": 4, "stop_token_ids": [9]},
               {"logit_bias": {3: 2.0}}, {"seed": 7, "temperature": 0.9}, {"seed": 7}]
    for trial in range(30):
        picked = [rng.choice(options) for _ in range(rng.randrange(1, 9))]
        requests = [Request(f"r{trial}-{i}", [3, 4], SamplingParams(max_tokens=9, **o))
                    for i, o in enumerate(picked)]
        for r in requests:
            r.output_token_ids.extend(rng.randrange(20) for _ in range(rng.randrange(6)))
        batch = RequestSampling(64, torch.device("cpu")).batch(requests)
        params = [r.sampling_params for r in requests]
        for name, neutral in [("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                              ("presence_penalty", 0.0)]:
            values = [getattr(p, name) for p in params]
            got = getattr(batch, name)
            assert (got is None) == all(v == neutral for v in values)
            if got is not None:
                assert got.tolist() == pytest.approx(values)
        assert batch.temperature.tolist() == pytest.approx([p.temperature for p in params])
        assert batch.banned == [(i, [9]) for i, (r, p) in enumerate(zip(requests, params))
                                if len(r.output_token_ids) < p.min_tokens]
        assert batch.bias == [(i, [3], [2.0]) for i, p in enumerate(params) if p.logit_bias]
        assert sorted(batch.generators) == [i for i, p in enumerate(params)
                                            if p.seed is not None and p.temperature > 0]


def _batch_fields(batch) -> dict:
    """A SamplingBatch as plain values (tensors listed, generators by identity)."""
    out = {}
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        elif name == "generators":
            value = {row: id(gen) for row, gen in value.items()}
        out[name] = value
    return out


def test_sampling_batch_reused_across_steps_equals_a_fresh_one():
    """The rows' settings are built once while the same requests run in the same order, the
    penalties' seen tokens and counts kept and updated by new tokens (a token counted while
    still on the device, then arriving on the host, counts once); what the tokens so far
    decide (min_tokens and bad-word bans) and finished seeded rows are still redone every
    step: equal to a batch built from scratch."""
    from tokenmill.core.request import RequestStatus

    def request(i, **kw):
        r = Request(f"r{i}", [3, 4, 5], SamplingParams(**kw))
        r.status = RequestStatus.RUNNING
        return r

    requests = [
        request(0, temperature=0),
        request(1, temperature=0.7, top_p=0.9, seed=3),
        request(2, temperature=1.0, min_tokens=2, stop_token_ids=[7]),
        request(3, temperature=0.5, bad_words=None, repetition_penalty=1.2,
                frequency_penalty=0.3, logit_bias={9: 2.0}),
        request(4, temperature=0.9, seed=5, top_k=4),
    ]
    requests[3].sampling_params.bad_words_token_ids = [[6, 8], [11]]
    cached = RequestSampling(64, torch.device("cpu"))
    reused = 0
    for step in range(5):
        if step == 3:
            requests[4].status = RequestStatus.FINISHED_ABORTED  # (in flight when aborted)
        if step == 4:
            requests = requests[1:]  # a request left: the settings are built anew
        before = cached._settings
        got = cached.batch(list(requests))
        reused += cached._settings is before
        fresh = RequestSampling(64, torch.device("cpu"))
        fresh._generators = cached._generators  # (the seeded rows' generators, as they are)
        want = fresh.batch(list(requests))
        assert _batch_fields(got) == _batch_fields(want), step
        token = 6 if step % 2 == 0 else 8
        if step in (1, 2):  # the token still on the device (asynchronous scheduling) ...
            rows = [(row, 0) for row in range(len(requests))]
            for sampling, batch in ((cached, got), (fresh, want)):
                sampling.count_in_flight(batch, rows, torch.tensor([token]))
            assert _batch_fields(got) == _batch_fields(want), step
        for r in requests:  # ... then on the host: counted once
            r.output_token_ids.append(token)
    assert reused == 3  # steps 1-3 reused step 0's settings; step 4 did not


def test_penalty_rows_carried_across_changing_request_lists_equal_fresh_ones():
    """Requests arrive, leave and change places while others run on, with tokens counted on
    the device before they land: the rows carried over from the last list (and the new
    requests' own) equal a batch built from scratch at every step."""
    from tokenmill.core.request import RequestStatus

    rng = random.Random(5)
    options = [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.4},
               {"presence_penalty": -0.2, "repetition_penalty": 0.9}, {}]

    def request(i):
        r = Request(f"r{i}", [rng.randrange(64) for _ in range(rng.randrange(1, 6))],
                    SamplingParams(temperature=0.7, **rng.choice(options)))
        r.status = RequestStatus.RUNNING
        return r

    running = [request(i) for i in range(5)]
    cached, carried = RequestSampling(64, torch.device("cpu")), 0
    in_flight = None  # (requests, token) counted on the device last step
    for step in range(60):
        if step % 3 == 1:  # arrivals, departures, reordering
            if running and rng.random() < 0.6:
                running.pop(rng.randrange(len(running)))
            running += [request(100 + step * 10 + k) for k in range(rng.randrange(0, 3))]
            if rng.random() < 0.3:
                rng.shuffle(running)
        if in_flight is not None:  # last step's token lands on the host
            for r in in_flight[0]:
                r.output_token_ids.append(in_flight[1])
            in_flight = None
        before = cached._settings
        got = cached.batch(list(running))
        carried += before is not None and cached._settings is not before and any(
            r is old for r in running for old in before[0])
        fresh = RequestSampling(64, torch.device("cpu"))
        want = fresh.batch(list(running))
        assert _batch_fields(got) == _batch_fields(want), step
        token = rng.randrange(64)
        if running and step % 2:  # counted while on the device, lands next step
            rows = [(row, 0) for row in range(len(running))]
            cached.count_in_flight(got, rows, torch.tensor([token]))
            in_flight = list(running), token
        else:
            for r in running:
                r.output_token_ids.append(token)
    assert carried > 10


def test_text_buffer_equals_a_plain_string():
    """Random appends (empty ones, runs past the 64-piece merge), tails from every start,
    reads and replacements, against a plain string."""
    rng = random.Random(3)
    for _ in range(40):
        buffer, text = TextBuffer(), ""
        for step in range(rng.randrange(1, 400)):
            piece = "".join(rng.choice("ab\u00e9\U0001f600 ") for _ in range(rng.randrange(0, 4)))
            buffer.append(piece)
            text += piece
            assert buffer.length == len(text)
            start = rng.randrange(len(text) + 2)
            assert buffer.tail(start) == text[start:]
            if step % 97 == 96:
                assert buffer.text == text
            if step % 151 == 150:
                text = text[:rng.randrange(len(text) + 1)]
                buffer.text = text
        assert [buffer.tail(k) for k in range(len(text) + 1)] == [text[k:]
                                                                for k in range(len(text) + 1)]
        assert buffer.text == text


def test_layout_of_block_row_views_equals_that_of_lists():
    """Step inputs over the scheduler's block-row views (int64 arrays) lay out as over plain
    lists (decodes, prompt chunks, graph padding rows) and travel to other ranks as lists."""
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randrange(1, 9)
        blocks = [rng.sample(range(1000), rng.randrange(1, 40)) for _ in range(n)]
        ends = [rng.randrange(1, len(b) * 16 + 1) for b in blocks]
        decode = rng.random() < 0.5
        starts = [e - 1 if decode else rng.randrange(0, e) for e in ends]
        tokens = [rng.randrange(100) for s, e in zip(starts, ends) for _ in range(e - s)]
        lists = StepInputs(tokens, starts, ends, blocks, list(range(n)), [], [], [1] * n)
        arrays = StepInputs(tokens, starts, ends, [np.array(b) for b in blocks],
                            list(range(n)), [], [], [1] * n)
        rows = rng.choice([0, n + 3])
        for a, b in zip(arrays.layout(16, rows), lists.layout(16, rows)):
            assert np.asarray(a).tolist() == np.asarray(b).tolist()
        assert StepInputs.decode(arrays.encode()) == lists
