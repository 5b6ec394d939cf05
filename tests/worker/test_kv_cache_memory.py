"""The host KV cache: zeroed, its rows on cache lines, and resident only as far as it has
been written (a server that has seen a few requests does not hold its whole budget)."""

import pytest
import torch

from tokenmill.worker.kv_cache import allocate_kv_cache


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8,
                                   torch.float8_e4m3fn])
def test_host_blocks_are_zero_aligned_and_of_their_dtype(dtype):
    caches = allocate_kv_cache(2, 64, 16, 2, 64, dtype, torch.device("cpu"))
    for k, v in caches:
        for t in (k, v):
            assert t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
            assert t.shape[:3] == (64, 16, 2)
            assert not t.float().any()
    k = caches[0][0]
    k[5] = 1  # each block writable on its own
    assert k[5].float().eq(1).all() and not k[4].float().any() and not caches[1][0].float().any()


def test_host_blocks_are_resident_only_once_written():
    from tokenmill.platforms.cpu import keep_freed_cpu_memory

    # A process that has used and freed more heap than the cache takes, as an engine has
    # after loading a model (and glibc told to keep it): the cache must still be fresh pages,
    # not that heap zeroed by writing.
    keep_freed_cpu_memory()
    churn = [torch.ones(2**20) for _ in range(96)]  # 4 MiB each: under the map threshold
    del churn
    before = _resident_bytes()
    caches = allocate_kv_cache(4, 1024, 16, 4, 128, torch.float32, torch.device("cpu"))
    total = sum(t.numel() * t.element_size() for kv in caches for t in kv)  # 256 MiB
    assert total == 256 * 2**20
    assert _resident_bytes() - before < total // 8
    for k, v in caches:  # a few blocks in use
        k[:8] = 1.0
        v[:8] = 1.0
    assert _resident_bytes() - before < total // 8
    for k, v in caches:  # all of them
        k.fill_(2.0)
        v.fill_(2.0)
    assert _resident_bytes() - before > total // 2
