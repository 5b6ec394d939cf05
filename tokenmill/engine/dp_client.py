"""Data parallel: several engine cores (replicas, each with its own tensor/pipeline ranks)
behind one asyncio client with `AsyncMPClient`'s interface. A request goes to the replica
whose prefix cache most likely holds the longest prefix of its prompt, then to the least
loaded (`PrefixRouter`); its aborts and stops follow it there; outputs and heartbeats come
back tagged with their replica's index."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from tokenmill.core.block_pool import hash_block_tokens
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.protocol import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest


class PrefixRouter:
    """Picks a replica per request: most full prompt blocks this router sent to it before
    (its cache is likely to still hold them: chained hashes, as the engine's prefix cache
    keys them), then fewest requests in flight, then the lowest index. Each replica's
    remembered blocks are bounded (least recently sent forgotten first). Keeps the books of
    which replica holds each request in flight (`assign`, `release`, `finished`)."""

    def __init__(self, replicas: int, block_size: int, remembered: int = 1 << 16) -> None:
        self.block_size = block_size
        self.remembered = remembered
        self.blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self.in_flight = [0] * replicas
        self.owner: dict[str, int] = {}  # request id -> replica, while in flight

    def _hashes(self, prompt: Sequence[int]) -> list[bytes]:
        hashes, parent = [], None
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(parent, prompt[start:start + self.block_size])
            hashes.append(parent)
        return hashes

    def choose(self, prompt: Sequence[int]) -> int:
        hashes = self._hashes(prompt)

        def matched(i: int) -> int:
            n = 0
            while n < len(hashes) and hashes[n] in self.blocks[i]:
                n += 1
            return n

        best = max(range(len(self.blocks)),
                   key=lambda i: (matched(i), -self.in_flight[i], -i))
        kept = self.blocks[best]
        for h in hashes:
            kept[h] = None
            kept.move_to_end(h)
        while len(kept) > self.remembered:
            kept.popitem(last=False)
        self.in_flight[best] += 1
        return best

    def done(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def assign(self, request_id: str, prompt: Sequence[int]) -> int:
        replica = self.owner[request_id] = self.choose(prompt)
        return replica

    def release(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Requests aborted or stopped here, by replica; they leave the books."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            replica = self.owner.pop(rid, None)
            if replica is not None:
                groups.setdefault(replica, []).append(rid)
                self.done(replica)
        return groups

    def finished(self, request_id: str) -> bool:
        """A request's last output arrived: off the books (False: it was not on them)."""
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.done(replica)
        return replica is not None


class DataParallelClient:
    def __init__(self, addresses: list[str]) -> None:
        self.replicas = [AsyncMPClient(address) for address in addresses]
        self.info: EngineCoreInfo | None = None
        self.router: PrefixRouter | None = None
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._heartbeats: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    async def connect(self) -> EngineCoreInfo:
        """Every replica's info; the one returned counts all their KV blocks."""
        infos = await asyncio.gather(*(r.connect() for r in self.replicas))
        first = infos[0]
        self.info = EngineCoreInfo(first.max_model_len, sum(i.num_kv_blocks for i in infos),
                                   first.block_size, first.vocab_size,
                                   sum(i.max_num_seqs for i in infos), loras=first.loras,
                                   pooler=first.pooler, multimodal=first.multimodal)
        self.router = PrefixRouter(len(infos), first.block_size)
        for i, replica in enumerate(self.replicas):
            self._pumps.append(asyncio.create_task(self._pump(replica.get_output,
                                                              self._outputs, i)))
            self._pumps.append(asyncio.create_task(self._pump(replica.get_heartbeat,
                                                              self._heartbeats, i)))
        return self.info

    @staticmethod
    async def _pump(receive, queue: asyncio.Queue, index: int) -> None:
        while True:
            try:
                _, item = await receive()
            except msgspec.DecodeError:  # not a message of ours: dropped, as one engine does
                continue
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which decides
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, item))

    async def add_request(self, request: EngineCoreRequest) -> None:
        replica = self.router.assign(request.request_id, request.prompt_token_ids)
        await self.replicas[replica].add_request(request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        for replica, ids in self.router.release(request_ids).items():
            await self.replicas[replica].abort_requests(ids)

    async def finish_requests(self, request_ids: list[str]) -> None:
        for replica, ids in self.router.release(request_ids).items():
            await self.replicas[replica].finish_requests(ids)

    async def update_lora(self, update, replica: int = 0) -> None:
        """To one replica (AsyncLLM.update_lora asks each in turn, with one id)."""
        await self.replicas[replica].update_lora(update)

    async def control(self, request, replica: int = 0) -> None:
        """To one replica (AsyncLLM.control asks each in turn)."""
        await self.replicas[replica].control(request)

    async def get_output(self) -> tuple[int, EngineCoreOutputs]:
        replica, batch = await self._outputs.get()
        if isinstance(batch, Exception):
            raise batch
        for out in batch.outputs:
            if out.finish_reason is not None:
                self.router.finished(out.request_id)
        return replica, batch

    async def get_heartbeat(self):
        replica, heartbeat = await self._heartbeats.get()
        if isinstance(heartbeat, Exception):
            raise heartbeat
        return replica, heartbeat

    async def shutdown_core(self) -> None:
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                await replica.shutdown_core()

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for replica in self.replicas:
            replica.close()
