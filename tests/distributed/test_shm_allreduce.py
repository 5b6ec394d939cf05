"""The shared-memory all-reduce against gloo's and against the sum in rank order: every rank
gets the same bits, buffers larger than a slot go through in chunks, an abort ends a wait."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tokenmill import csrc
from tokenmill.distributed import shm_allreduce

pytestmark = pytest.mark.skipif(not csrc.available() or not os.path.isdir("/dev/shm"),
                                reason="needs the compiled kernels and /dev/shm")

SIZES = [1, 7, 896, 32 * 896, shm_allreduce.SLOT_FLOATS + 5]  # the last one: two chunks


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g) * (10 ** (rank - 1)) for n in SIZES]


def rank_main(rank: int, size: int, rendezvous: str, shm_path: str, out) -> None:
    from tokenmill.distributed.parallel_state import get_tp_group, init_parallel

    torch.set_num_threads(1)
    init_parallel(rank, size, rendezvous, 60, shm_paths=[shm_path])
    tp = get_tp_group()
    assert tp.shm is not None
    results = []
    for x in inputs(rank):
        ours = tp.all_reduce(x.clone())  # twice: the parity of the slots alternates
        again = tp.all_reduce(x.clone())
        theirs = x.clone()
        tp.backend.allreduce([theirs]).wait()  # gloo's
        # as bytes: a tensor put on the queue would be shared memory that dies with this process
        results.append(tuple(t.numpy().tobytes() for t in (ours, again, theirs)))
    out.put((rank, results))


@pytest.mark.parametrize("size", [2, 3])
def test_sums_match_gloo_and_rank_order_on_every_rank(tmp_path, size):
    path = shm_allreduce.create_segment(size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, f"file://{tmp_path}/rdv", path, out))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=300) for _ in range(size))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert not os.path.exists(path)  # unlinked once every rank had mapped it
    reference = [sum(parts[1:], parts[0].clone()) for parts in zip(*map(inputs, range(size)))]
    for i, ref in enumerate(reference):
        for rank in range(size):
            ours, again, theirs = (torch.frombuffer(bytearray(b), dtype=torch.float32)
                                   for b in got[rank][i])
            assert torch.equal(ours, ref) and torch.equal(again, ref)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_an_abort_ends_a_wait_for_a_rank_that_never_comes():
    path = shm_allreduce.create_segment(2)
    try:
        shm = shm_allreduce.ShmAllReduce(path, 0, 2)
        shm.abort()
        with pytest.raises(RuntimeError, match="rank died during an all-reduce"):
            shm(torch.ones(4))
    finally:
        os.unlink(path)
