"""The engine core in its own process, driven over ZMQ by the asyncio front (AsyncLLM)."""

import asyncio

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.engine.async_engine import AsyncLLM, EngineRequestError
from tokenmill.engine.core_client import AsyncMPClient, start_engine_core_process
from tokenmill.loading.checkpoint import load_tokenizer
from tokenmill.tokenizer import eos_token_ids

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_process(tiny_models):
    path = tiny_models("qwen2")[0]
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, max_model_len=256)
    process, address, info = start_engine_core_process(config, path)
    yield path, address, info
    process.kill()
    process.join(10)


async def with_engine(path, address, body):
    tokenizer = load_tokenizer(path)
    llm = AsyncLLM(AsyncMPClient(address), tokenizer, eos_token_ids(tokenizer, path))
    await llm.start()
    try:
        return await body(llm)
    finally:
        await llm.shutdown()


async def collect(llm, prompt, params, request_id=None):
    last = None
    async for out in llm.generate(prompt, params, request_id):
        last = out
    return last


def test_concurrent_requests_match_offline(engine_process, tiny_models):
    path, address, info = engine_process
    assert info.max_model_len == 256

    async def body(llm):
        outs = await asyncio.gather(*(collect(llm, p, GREEDY) for p in PROMPTS))
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]

    tokens, texts = asyncio.run(with_engine(path, address, body))
    offline = LLM(path, kv_cache_memory_gib=0.02).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in offline]
    assert texts == [o.outputs[0].text for o in offline]


def test_refused_request_does_not_disturb_others(engine_process):
    path, address, _ = engine_process

    async def body(llm):
        good = asyncio.create_task(collect(llm, PROMPTS[0], GREEDY))
        with pytest.raises(EngineRequestError, match="max_model_len"):
            await collect(llm, [3] * 300, GREEDY)
        return await good

    out = asyncio.run(with_engine(path, address, body))
    assert len(out.outputs[0].token_ids) == 12 and out.finished


def test_leaving_the_stream_aborts_and_frees_blocks(engine_process):
    path, address, _ = engine_process
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(llm):
        stream = llm.generate(PROMPTS[1], long)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()  # what a server does when its client disconnects
        for _ in range(100):  # the core reports its state with every heartbeat
            await asyncio.sleep(0.05)
            if llm.stats.num_running == 0 and llm.stats.kv_blocks_used == 0:
                return llm.stats
        return llm.stats

    stats = asyncio.run(with_engine(path, address, body))
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


def test_start_failure_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        start_engine_core_process(EngineConfig(model=str(tmp_path)), str(tmp_path),
                                  timeout_s=120)


def test_generated_tokens_are_counted_as_they_arrive_not_at_the_end():
    """tokenmill:generation_tokens_total grows with every step's tokens (vLLM's counting), so
    the dashboard's and Grafana's rate over it move while long generations run; the totals
    at the end are what they were (finished and aborted requests alike)."""
    from tokenmill.engine.request_stream import RequestTimer
    from tokenmill.metrics import Metrics
    from tokenmill.outputs import CompletionOutput, RequestOutput

    metrics = Metrics("tiny", 8)
    counted = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "tokenmill:generation_tokens_total", {"model_name": "tiny"}) or 0

    def delta(tokens: list[int], reason: str | None = None) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", tokens, reason)],
                             finished=reason is not None)

    timer, aborted = RequestTimer(metrics, 2), RequestTimer(metrics, 2)
    assert counted() == 0
    timer.output(delta([5, 6, 7]))
    assert counted() == 3  # (the request still running)
    aborted.output(delta([9]))
    aborted.finish("abort")
    assert counted() == 4
    timer.output(delta([8], "length"))
    assert counted() == 5
    assert metrics.registry.get_sample_value("tokenmill:request_generation_tokens_sum",
                                             {"model_name": "tiny"}) == 5
