"""The KV cache's host-memory tier (--kv-offloading-size): blocks the engine's cache lets go
come back from host memory on a prefix hit, token for token as computing them; the tier is
bounded with the least recently used going first; in front of the disk tier it keeps what
it reads from disk; its counts reach the stats and metrics; what it cannot run with is
refused by name. (On this CPU machine the engine's cache is host memory too: the tier is
for GPU engines, and its copies go through the same device-agnostic block copies.)"""

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.kv_offload.host_store import HostKVStore
from tokenmill.worker.kv_blocks import block_bytes

PROMPT = [(i * 7) % 400 + 3 for i in range(200)]  # (12 full blocks of 16 and 8 tokens)
OTHERS = [[(i * k) % 300 + 5 for i in range(200)] for k in (11, 13, 17)]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def generate(llm, prompt):
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def baseline(tiny_models):
    path = tiny_models("llama")[0]
    with LLM(path, kv_cache_memory_gib=0.02, max_model_len=512) as llm:
        return [generate(llm, p)[0] for p in [PROMPT, *OTHERS]]


def test_blocks_the_cache_let_go_come_back_from_host_memory(tiny_models, baseline):
    path = tiny_models("llama")[0]
    # 16 blocks in the engine: each prompt (13 blocks) pushes the one before out of it
    with LLM(path, num_kv_blocks=16, max_model_len=512, kv_offloading_size=0.05) as llm:
        assert [generate(llm, p)[0] for p in [PROMPT, *OTHERS]] == baseline
        tier = llm.engine.core.offload_tier
        assert tier.flush(60) and tier.host.num_saved == 48 and tier.disk is None
        tokens, cached = generate(llm, PROMPT)
        assert tokens == baseline[0] and cached == 192
        assert tier.num_read_blocks == 12 and tier.host.num_loaded == 12
        llm.engine.core.kv_cache.pool.check_integrity()
        stats = llm.engine.core.stats()
    assert (stats.kv_host_read_blocks, stats.kv_host_written_blocks,
            stats.kv_host_evicted_blocks) == (12, 48, 0)
    from tokenmill.metrics import Metrics

    metrics = Metrics("tiny", 8)
    metrics.observe_stats(stats)
    assert metrics.registry.get_sample_value("tokenmill:kv_host_blocks_read_total", {
        "model_name": "tiny", "engine": "0"}) == 12


def test_the_bound_lets_the_least_recently_used_go(tiny_models, baseline):
    path = tiny_models("llama")[0]
    engine = dict(num_kv_blocks=16, max_model_len=512)
    with LLM(path, **engine) as llm:
        size = block_bytes(llm.engine.core.runner)
    with LLM(path, **engine, kv_offloading_size=30 * size / 2**30) as llm:  # (30 blocks)
        for prompt in [PROMPT, *OTHERS]:
            generate(llm, prompt)
        tier = llm.engine.core.offload_tier
        assert tier.flush(60) and tier.host.num_blocks == 30 and tier.host.num_evicted == 18
        tokens, cached = generate(llm, PROMPT)  # (its blocks went first: computed again)
        assert tokens == baseline[0] and cached == 0
        tokens, cached = generate(llm, OTHERS[-1])  # (the latest: still there)
        assert tokens == baseline[-1] and cached == 192


def test_in_front_of_the_disk_tier(tiny_models, tmp_path, baseline):
    path = tiny_models("llama")[0]
    engine = dict(num_kv_blocks=16, max_model_len=512, kv_offloading_size=0.05,
                  kv_cache_disk_dir=str(tmp_path))
    with LLM(path, **engine) as llm:
        generate(llm, PROMPT)
        assert llm.engine.core.offload_tier.flush(60)
        assert llm.engine.core.offload_tier.disk.num_saved == 12
    with LLM(path, **engine) as llm:  # (a restart: host memory empty, the disk not)
        tier = llm.engine.core.offload_tier
        assert generate(llm, PROMPT) == (baseline[0], 192)
        assert tier.disk.num_loaded == 12 and tier.host.num_blocks == 12
        generate(llm, OTHERS[0])  # (the engine keeps PROMPT's first 3 blocks: its hits,
        # which the 9 blocks read back must not displace)
        assert generate(llm, PROMPT) == (baseline[0], 192)
        # (what the engine's cache let go came from memory, not the disk again)
        assert tier.disk.num_loaded == 12 and 0 < tier.host.num_loaded <= 12


def test_host_store():
    class Below:
        def __init__(self):
            self.blocks = {}

        def contains(self, h):
            return h in self.blocks

        def save(self, h, payload):
            self.blocks[h] = payload

        def load(self, h):
            return self.blocks.get(h)

    below = Below()
    store = HostKVStore(3 * 4, 4, below=below)
    for i in range(3):
        store.save(bytes([i]), bytes([i]) * 4)
    assert store.load(b"\x00") == b"\x00" * 4  # (now the most recent)
    store.save(b"\x03", b"\x03" * 4)
    assert store.num_blocks == 3 and store.num_evicted == 1
    assert not store._blocks.get(b"\x01") and store.contains(b"\x01")  # (on the disk still)
    assert store.load(b"\x01") == b"\x01" * 4 and b"\x01" in store._blocks
    assert store.load(b"\x09") is None
    with pytest.raises(ValueError, match="bytes"):
        store.save(b"\x05", b"short")
    with pytest.raises(ValueError, match="holds no block"):
        HostKVStore(3, 4)


def test_refused_by_name(tiny_models):
    path = tiny_models("llama")[0]
    for extra, words in (({"kv_offloading_size": 0}, "kv_offloading_size"),
                         ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"},
                          "native"),
                         ({"kv_offloading_size": 1, "enable_prefix_caching": False},
                          "--kv-offloading-size is not built with --no-enable-prefix"),
                         ({"kv_offloading_size": 1, "async_scheduling": True},
                          "--kv-offloading-size is not built with --async-scheduling")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(model=path, **extra)
