"""An engine-core client whose outputs the caller scripts: AsyncLLM's API-process side
(output processing, result kinds, readers) without an engine (tests/engine/test_output_kinds.py,
bench/api_outputs.py)."""

import asyncio

from tokenmill.engine.protocol import EngineCoreInfo, EngineCoreOutput, EngineCoreOutputs


class ScriptedClient:
    """The engine-core client AsyncLLM drives, fed by the test: `send(outputs)` queues one
    batch; `drained()` waits until AsyncLLM has processed every batch sent and asks for the
    next one."""

    num_replicas = 1

    def __init__(self) -> None:
        self.info = EngineCoreInfo(max_model_len=4096, num_kv_blocks=64, block_size=16,
                                   vocab_size=256)
        self.batches: asyncio.Queue = asyncio.Queue()
        self.waiting = asyncio.Event()
        self.added: list[str] = []

    async def connect(self) -> EngineCoreInfo:
        return self.info

    async def add_request(self, request) -> None:
        self.added.append(request.request_id)

    async def abort_requests(self, request_ids) -> None:
        pass

    async def finish_requests(self, request_ids) -> None:
        pass

    async def get_output(self):
        if self.batches.empty():
            self.waiting.set()
        batch = await self.batches.get()
        self.waiting.clear()
        return 0, batch

    async def get_heartbeat(self):
        await asyncio.Event().wait()  # none: the test ends first

    def send(self, outputs: list[EngineCoreOutput]) -> None:
        self.waiting.clear()
        self.batches.put_nowait(EngineCoreOutputs(outputs))

    async def drained(self) -> None:
        await asyncio.wait_for(self.waiting.wait(), 30)

    def close(self) -> None:
        pass
