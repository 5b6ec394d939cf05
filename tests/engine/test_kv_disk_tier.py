"""The KV cache's disk tier (--kv-cache-disk-dir): a restarted engine reads a prompt's blocks
back from disk instead of computing them, and answers token for token as an engine without
the tier; a corrupt, truncated or foreign file is never served (deleted, its block
recomputed); another model's (or another KV dtype's) blocks are not found; a disk that
refuses writes leaves the engine serving; the folder stays within its bound, least recently
used files going first; what the tier cannot run with is refused by name."""

import errno
import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.kv_offload.disk_store import DiskKVStore

PROMPT = [(i * 7) % 400 + 3 for i in range(200)]  # (12 full blocks of 16 and 8 tokens)
OTHER = PROMPT[:100] + [(i * 11) % 300 + 5 for i in range(60)]  # (shares 6 blocks)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def run(path, prompts, **engine):
    """Each prompt's tokens and cached-token count, one request at a time; the tier's
    counts."""
    with LLM(path, kv_cache_memory_gib=0.02, max_model_len=512, **engine) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0]
                for p in prompts]
        tier = llm.engine.core.offload_tier
        assert tier is None or tier.flush(60)  # (what the writer thread has queued: written)
        counts = None if tier is None else (tier.num_read_blocks, tier.store.num_saved,
                                            tier.store.num_rejected)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs], \
        counts


def block_files(root):
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                  if f.endswith(".kv"))


@pytest.fixture(scope="module")
def baseline(tiny_models):
    path = tiny_models("llama")[0]
    return run(path, [PROMPT, OTHER])[0]


def test_a_restarted_engine_reads_the_prefix_back(tiny_models, tmp_path, baseline):
    path = tiny_models("llama")[0]
    first, cached, (read, saved, _) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    assert first == baseline[:1] and cached == [0] and read == 0 and saved == 12
    assert len(block_files(tmp_path)) == 12
    again, cached, (read, saved, rejected) = run(path, [PROMPT, OTHER],
                                                  kv_cache_disk_dir=str(tmp_path))
    assert again == baseline
    assert cached == [192, 96] and read == 12 and rejected == 0
    assert saved == 4  # (OTHER: its 6 shared blocks in memory by then, its 4 new ones written)


def test_bad_files_are_never_served(tiny_models, tmp_path, baseline):
    path = tiny_models("llama")[0]
    run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    store_dir = os.path.dirname(os.path.dirname(block_files(tmp_path)[0]))
    from tokenmill.core.block_pool import hash_block_tokens

    hashes, parent = [], None
    for i in range(12):
        parent = hash_block_tokens(parent, PROMPT[16 * i:16 * (i + 1)])
        hashes.append(parent)
    path_of = lambda h: os.path.join(store_dir, h.hex()[:2], h.hex() + ".kv")  # noqa: E731
    with open(path_of(hashes[4]), "r+b") as f:  # block 4: one payload byte flipped
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(path_of(hashes[2]), "rb") as f:  # block 2: another block's file (foreign)
        foreign = f.read()
    with open(path_of(hashes[3]), "wb") as f:
        f.write(foreign)
    again, cached, (read, _, rejected) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    assert again == baseline[:1]
    assert read == 3 and cached == [48] and rejected == 1  # (blocks 0-2; block 3 refused)
    # block 3 was written again; block 4's bad file, never read, is refused now
    _, cached, (read, _, rejected) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    assert cached == [64] and read == 4 and rejected == 1
    _, cached, (read, _, rejected) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    assert cached == [192] and read == 12 and rejected == 0  # (all good again)
    truncated = path_of(hashes[0])
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    _, cached, (read, _, rejected) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    assert cached == [0] and read == 0 and rejected == 1


def test_another_model_or_kv_dtype_finds_nothing(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    _, cached, (read, saved, _) = run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path),
                                      kv_cache_dtype="int8")
    assert cached == [0] and read == 0 and saved == 12
    _, cached, (read, _, _) = run(tiny_models("qwen2")[0], [PROMPT],
                                  kv_cache_disk_dir=str(tmp_path))
    assert cached == [0] and read == 0
    assert len({os.path.dirname(os.path.dirname(f)) for f in block_files(tmp_path)}) == 3


def test_a_full_disk_leaves_the_engine_serving(tiny_models, tmp_path, baseline, monkeypatch,
                                               caplog):
    path = tiny_models("llama")[0]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_open = open
    monkeypatch.setattr("builtins.open", lambda file, mode="r", *a, **k: full()
                        if str(file).endswith(".tmp") else real_open(file, mode, *a, **k))
    outs, _, (read, saved, _) = run(path, [PROMPT, OTHER], kv_cache_disk_dir=str(tmp_path))
    assert outs == baseline and saved == 0 and block_files(tmp_path) == []
    warnings = [r for r in caplog.records if "could not be written" in r.message]
    assert len(warnings) == 1 and "No space left" in warnings[0].message


def test_the_folder_keeps_to_its_bound(tmp_path):
    """Files of 1223 bytes under a 12,000-byte bound: a write past it deletes the least
    recently used down to 90 % of it; a read makes a file recently used."""
    store = DiskKVStore(str(tmp_path), max_bytes=12_000, key={"m": 1}, block_bytes=1000)
    names = [bytes([i]) * 32 for i in range(14)]

    def write(i):
        assert store.save(names[i], bytes([i]) * 1000)
        os.utime(store.path(names[i]), (1000 + i, 1000 + i))  # (a second apart, in order)

    for i in range(10):
        write(i)
    assert [store.contains(n) for n in names[:10]] == [False] * 2 + [True] * 8
    assert store.load(names[2]) == bytes([2]) * 1000  # (its mtime now: the most recent)
    for i in range(10, 12):
        write(i)
    kept = [i for i, n in enumerate(names) if store.contains(n)]
    assert kept == [2, 5, 6, 7, 8, 9, 10, 11]
    assert sum(os.path.getsize(f) for f in block_files(tmp_path)) <= 12_000
    assert store.load(b"\x99" * 32) is None  # (not there: no error)


def test_what_it_cannot_run_with_is_refused(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    for extra, word in (({"enable_prefix_caching": False}, "--no-enable-prefix-caching"),
                        ({"async_scheduling": True}, "--async-scheduling"),
                        ({"tensor_parallel_size": 2}, "tensor or pipeline"),
                        ({"enable_sleep_mode": True}, "--enable-sleep-mode"),
                        ({"kv_cache_disk_gib": 0}, "kv_cache_disk_gib")):
        with pytest.raises(ValueError, match=word):
            EngineConfig(model=path, kv_cache_disk_dir=str(tmp_path), **extra)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ValueError, match="cannot be written"):
        LLM(path, kv_cache_memory_gib=0.02, kv_cache_disk_dir=str(blocked / "kv"))


def test_two_live_engines_share_the_folder(tiny_models, tmp_path, baseline):
    """As the data-parallel replicas of one machine: what one engine wrote, the other reads
    while both run."""
    path = tiny_models("llama")[0]
    engine = dict(kv_cache_memory_gib=0.02, max_model_len=512, kv_cache_disk_dir=str(tmp_path))
    with LLM(path, **engine) as first, LLM(path, **engine) as second:
        out = first.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0]
        assert first.engine.core.offload_tier.flush(60)
        again = second.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0]
        assert second.engine.core.offload_tier.num_read_blocks == 12
    assert again.num_cached_tokens == 192
    assert list(out.outputs[0].token_ids) == list(again.outputs[0].token_ids) == baseline[0]


def test_the_tier_counts_into_the_engine_stats_and_metrics(tiny_models, tmp_path):
    from tokenmill.metrics import Metrics

    path = tiny_models("llama")[0]
    run(path, [PROMPT], kv_cache_disk_dir=str(tmp_path))
    engine = dict(kv_cache_memory_gib=0.02, max_model_len=512, kv_cache_disk_dir=str(tmp_path))
    with LLM(path, **engine) as llm:
        llm.generate([{"prompt_token_ids": OTHER}], PARAMS, use_tqdm=False)
        assert llm.engine.core.offload_tier.flush(60)
        stats = llm.engine.core.stats()
    assert (stats.kv_disk_read_blocks, stats.kv_disk_written_blocks,
            stats.kv_disk_rejected_blocks, stats.kv_disk_dropped_blocks) == (6, 4, 0, 0)
    metrics = Metrics("tiny", 8)
    metrics.observe_stats(stats)
    value = lambda name: metrics.registry.get_sample_value(  # noqa: E731
        f"tokenmill:{name}_total", {"model_name": "tiny", "engine": "0"})
    assert (value("kv_disk_blocks_read"), value("kv_disk_blocks_written")) == (6, 4)
