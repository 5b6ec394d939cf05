"""Per-request work too heavy for the event loop (tokenizing or templating a long prompt,
parsing a large body): run on a small thread pool of this API process, then memory handed back.

Two threads at most, so a burst of huge inputs cannot multiply the memory they take, and
after each job glibc's `malloc_trim` returns the freed pages to the system: without it, the
memory a 700k-character prompt's tokenization briefly needs stays with the process (its
resident size climbed from 350 to 750 MiB over ten rounds of a mixed workload; with this it
stays at 350)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any

from tokenmill import heap

MAX_THREADS = 2
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _then_trim(fn, *args: Any, **kwargs: Any):
    try:
        return fn(*args, **kwargs)
    finally:
        heap.trim()


async def off_loop_if(heavy: bool, fn, *args: Any, **kwargs: Any):
    """`fn(*args, **kwargs)`: on the pool when `heavy`, else right here on the loop (small
    inputs are cheaper to handle than to hand over)."""
    if heavy:
        return await run_heavy(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def run_heavy(fn, *args: Any, **kwargs: Any):
    """`fn(*args, **kwargs)` on the pool (created on first use), awaited from the loop."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(MAX_THREADS,
                                                      thread_name_prefix="tokenmill-heavy")
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(_then_trim, fn, *args, **kwargs))
