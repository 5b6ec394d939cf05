"""The API process's memory stays flat under a repeated mixed workload (catalogue L2 for the
process that parses, tokenizes and templates): small requests on every front end, refusals,
and prompts of ~700k characters that fit the long-context model and so are tokenized. Before
heavy work ran on a bounded pool that trims the heap afterwards, the supervisor grew from
~350 to ~750 MiB over ten such rounds."""

import httpx
import psutil

from tests.serving import Served

ROUNDS = 8


def one_round(client: httpx.Client, api: str, r: int) -> None:
    for i in range(6):
        client.post(api + "/v1/completions", json={"model": "tiny", "prompt": f"hi {r} {i}",
                                                   "max_tokens": 8})
        client.post(api + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": f"hello {i}"}]})
        client.post(api + "/v1/chat/completions", json={"text": f"native {i}",
                                                        "max_dec_len": 8, "stream": True})
        client.post(api + "/v2/models/ensemble/generate", json={"text_input": f"triton {i}",
                                                                "max_tokens": 8})
        client.post(api + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0})
        client.post(api + "/v1/completions", content=b"{" * 100)
    for k in range(3):  # tokenized (they could fit 32k tokens), then refused for their length
        big = client.post(api + "/v1/completions", json={
            "model": "tiny", "prompt": f"{k} " + "hello world " * 60_000, "max_tokens": 1})
        assert big.status_code == 400 and "maximum context length" in big.text, big.text[:300]
        client.post(api + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1,
            "messages": [{"role": "user", "content": "abc " * 3000}]})


def test_api_process_memory_stays_flat_under_a_mixed_workload(tiny_models, tmp_path):
    served = Served(tiny_models("llama_long")[0], tmp_path, "--max-model-len", "32768")
    with served.running(), httpx.Client(timeout=300) as client:
        api_process = psutil.Process(served.process.pid)
        start = api_process.memory_info().rss / 2**20
        rss = []
        for r in range(ROUNDS):
            one_round(client, served.api, r)
            rss.append(api_process.memory_info().rss / 2**20)
        print(f"API process RSS (MiB): {start:.0f} at start, after each round:",
              [round(x) for x in rss])
        # Nothing kept: the heavy jobs' memory goes back (without the trim: +280 MiB).
        assert max(rss) - start < 128, (start, rss)
        # Flat: the later rounds add nothing to what the first ones set up.
        assert max(rss[2:]) - rss[1] < 64, rss
