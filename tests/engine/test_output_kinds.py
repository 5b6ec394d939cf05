"""AsyncLLM's result kinds over a scripted engine core (no model): deltas, cumulative and
final-only results against the offline OutputProcessor's cumulative ones, and a reader that
fell behind getting the deltas it missed as one."""

import asyncio
import random

import pytest

from tests.scripted_client import ScriptedClient
from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.protocol import EngineCoreOutput
from tokenmill.outputs import OutputKind


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from tokenmill.loading.checkpoint import load_tokenizer

    return load_tokenizer(tiny_models("llama")[0])


def _script(seed: int, steps: int, n: int) -> list[list[list[int]]]:
    """Per step, per child: the new token ids (1-3, the last step ends every child)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 250) for _ in range(rng.randint(1, 3))] for _ in range(n)]
            for _ in range(steps)]


def _outputs(children: list[str], step: list[list[int]], last: bool) -> list[EngineCoreOutput]:
    return [EngineCoreOutput(child, ids, finish_reason=1 if last else None, new_logprobs=[
        ([t, t + 1], [-0.5, -1.5], -0.5, 1) for t in ids]) for child, ids in zip(children, step)]


def _reference(tokenizer, params, script) -> list:
    """The offline processor's cumulative result after each step."""
    processor = OutputProcessor(tokenizer)
    children = processor.add_request("r", None, [5, 6, 7], params)
    results = []
    for i, step in enumerate(script):
        [result], _ = processor.process_outputs(_outputs(children, step, i == len(script) - 1))
        results.append(result)
    return results


def _run(tokenizer, params, script, kind, read_after: set[int]):
    """Feeds the script step by step; the reader takes a result only after the steps in
    `read_after` (and at the end). Returns the results the reader got, by step."""

    async def body():
        client = ScriptedClient()
        llm = AsyncLLM(client, tokenizer, [2])
        await llm.start()
        stream = llm.generate([5, 6, 7], params, request_id="r", output_kind=kind)
        got: dict[int, list] = {}
        first = asyncio.ensure_future(anext(stream))
        while len(client.added) < params.n:
            await asyncio.sleep(0)
        pending = first
        for i, step in enumerate(script):
            client.send(_outputs(client.added, step, i == len(script) - 1))
            await client.drained()
            if i in read_after or i == len(script) - 1:
                if pending is None:
                    pending = asyncio.ensure_future(anext(stream))
                if kind is OutputKind.FINAL_ONLY and i < len(script) - 1:
                    await asyncio.sleep(0)
                    assert not pending.done()  # nothing before the end
                    continue
                got[i] = [await asyncio.wait_for(pending, 30)]
                pending = None
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        await llm.shutdown()
        return got

    return asyncio.run(body())


@pytest.mark.parametrize("n", [1, 2])
def test_deltas_add_up_to_the_cumulative_results_whenever_the_reader_reads(tokenizer, n):
    params = SamplingParams(n=n, max_tokens=100, logprobs=1, seed=0)
    script = _script(n, 12, n)
    reference = _reference(tokenizer, params, script)
    read_after = {0, 1, 5, 6, 9}  # so the reader misses steps 2-5 (one result for them) ...
    got = _run(tokenizer, params, script, OutputKind.DELTA, read_after)
    assert sorted(got) == [0, 1, 5, 6, 9, 11]
    texts, ids, logprobs = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for step, [out] in sorted(got.items()):
        whole = reference[step]
        for c in out.outputs:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
            logprobs[c.index] += c.logprobs
            w = whole.outputs[c.index]
            # ... and each result brings the reader exactly to the cumulative state
            assert (texts[c.index], ids[c.index], logprobs[c.index]) == \
                (w.text, w.token_ids, w.logprobs)
            assert (c.finish_reason, c.cumulative_logprob) == \
                (w.finish_reason, w.cumulative_logprob)
        assert out.finished == whole.finished
    assert all(len(x) == sum(len(s[k]) for s in script) for k, x in enumerate(ids))


def test_cumulative_and_final_only_results_equal_the_offline_ones(tokenizer):
    params = SamplingParams(n=2, max_tokens=100, logprobs=1, seed=0)
    script = _script(7, 9, 2)
    reference = _reference(tokenizer, params, script)
    got = _run(tokenizer, params, script, OutputKind.CUMULATIVE, {0, 3, 4})
    for step, [out] in got.items():
        assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs] == \
            [(c.text, c.token_ids, c.logprobs, c.finish_reason)
             for c in reference[step].outputs]
    got = _run(tokenizer, params, script, OutputKind.FINAL_ONLY, {0, 3, 4})
    [(step, [out])] = got.items()
    assert step == len(script) - 1 and out.finished
    assert [(c.text, c.token_ids, c.logprobs) for c in out.outputs] == \
        [(c.text, c.token_ids, c.logprobs) for c in reference[-1].outputs]


@pytest.mark.parametrize("interval", [1, 4, 7])
def test_a_stream_interval_hands_on_first_tokens_then_every_n_then_the_end(tokenizer, interval):
    """A reader that keeps up is woken at the first tokens, then once `interval` tokens are
    held, and at the end; what it gets adds up to the offline results at each of those steps.
    Cumulative readers ignore the interval."""
    params = SamplingParams(n=2, max_tokens=100, logprobs=1, seed=0)
    script = _script(interval, 14, 2)
    reference = _reference(tokenizer, params, script)
    expected, held = [0], 0
    for i, step in enumerate(script[1:], 1):
        held += sum(map(len, step))
        if held >= interval or i == len(script) - 1:
            expected.append(i)
            held = 0

    async def body(kind):
        client = ScriptedClient()
        llm = AsyncLLM(client, tokenizer, [2], stream_interval=interval)
        await llm.start()
        got, at = [], [None]

        async def read():
            async for out in llm.generate([5, 6, 7], params, request_id="r", output_kind=kind):
                got.append((at[0], out))

        reader = asyncio.ensure_future(read())
        while len(client.added) < params.n:
            await asyncio.sleep(0)
        for i, step in enumerate(script):
            at[0] = i
            client.send(_outputs(client.added, step, i == len(script) - 1))
            await client.drained()
            for _ in range(5):  # (the reader's turn, if it was woken)
                await asyncio.sleep(0)
        await asyncio.wait_for(reader, 30)
        await llm.shutdown()
        return got

    got = asyncio.run(body(OutputKind.DELTA))
    assert [step for step, _ in got] == expected
    texts, ids = ["", ""], [[], []]
    for step, out in got:
        for c in out.outputs:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
        assert [(c.text, c.token_ids) for c in reference[step].outputs] == list(zip(texts, ids))
    got = asyncio.run(body(OutputKind.CUMULATIVE))
    assert [step for step, _ in got] == list(range(len(script)))


def test_a_stream_interval_below_1_is_refused(tokenizer):
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1, got 0"):
        AsyncLLM(ScriptedClient(), tokenizer, [2], stream_interval=0)
