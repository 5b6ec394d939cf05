"""What the scale-out tests share: a stream held in flight, the engine-death ending it must
get, and the worker-rank processes of a process tree."""

import json

import psutil

from tests.reliability.streams import Stream
from tests.serving import HOLD_TOKENS, alive, wait_until
from tokenmill.executor.worker import __name__ as WORKER_MODULE


def held_stream(api: str, prompt: str = "story number 0") -> Stream:
    """A streaming completion of HOLD_TOKENS tokens, already streaming when returned."""
    stream = Stream(api, {"model": "tiny", "prompt": prompt, "max_tokens": HOLD_TOKENS,
                          "ignore_eos": True, "temperature": 0})
    stream.start()
    assert stream.started.wait(120)
    return stream


def assert_ended_by_engine_death(stream: Stream) -> None:
    """The stream ends with the engine-death error, before its tokens ran out: no chunk
    names a finish reason (how far it got depends on the machine's speed, not asserted)."""
    stream.join(300)  # bounds a hang only
    events = [line[6:] for line in stream.lines if line.startswith("data: ")]
    errors = [json.loads(e) for e in events if e.startswith('{"error"')]
    assert errors and errors[0]["error"]["code"] == 503, events[-3:]
    assert events[-1] == "[DONE]" and events[-2].startswith('{"error"'), events[-3:]
    assert not any('"finish_reason":"' in e for e in events), events[-3:]
    assert len(events) < HOLD_TOKENS


def assert_server_died(served, streams: list[Stream], pids: list[int]) -> None:
    """The engine-death policy: each stream ended by its error, the server exited 1, and
    none of `pids` is left running, nor any of its ports bound."""
    for stream in streams:
        assert_ended_by_engine_death(stream)
    assert served.process.wait(120) == 1
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 60)
    assert wait_until(served.ports_free, 60)


def tree(pid: int | None = None) -> list[psutil.Process]:
    """A process's descendants (this process's when `pid` is None)."""
    return psutil.Process(pid).children(recursive=True)


def worker_ranks(pid: int | None = None) -> list[psutil.Process]:
    """The tensor-parallel worker-rank processes below `pid` (or this process)."""
    return [p for p in tree(pid) if WORKER_MODULE in " ".join(p.cmdline())]
