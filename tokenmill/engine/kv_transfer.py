"""Prefill/decode disaggregation in the engine core (`--kv-transfer-config`): a NIXL agent
over this engine's KV cache tensors, in both roles (vLLM's NixlConnector protocol).

Prefill side: a request asking `{"do_remote_decode": true}` runs as usual (the proxy asks
one token); when it finishes, its full prompt blocks stay referenced, and its answer carries
`kv_transfer_params`: this agent's metadata, the block ids and the cache tensors' addresses.
The blocks go back to the pool when the decode side's read notifies this agent, or after
`hold_seconds`. Decode side: a request carrying those parameters takes fresh blocks for the
full prompt blocks past its own prefix-cache hits, READs the remote blocks into them (one
descriptor per block and cache tensor; the step loop goes on meanwhile), then enters the
scheduler with them in the prefix cache, so it computes only the prompt's last partial block
and samples from there: its tokens are one engine's. A read that fails (the prefill instance
gone) or outlasts `timeout_seconds` finishes the request with a 503; parameters that are not
this deployment's (bad signature, another model's layout) with a 400; a prompt whose blocks
do not match the ones prefilled is computed here instead."""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import hmac
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.config.kv_transfer import KVTransferConfig, signed_text
from tokenmill.core.request import Request, RequestStatus
from tokenmill.worker.kv_blocks import cache_tensors

logger = logging.getLogger(__name__)

DONE = b"tokenmill-kv-done:"  # + transfer id: the decode side read (or will not read) them
MAX_PEERS = 64  # remote agents kept connected (least recently used dropped past it)


class TransferRefused(Exception):
    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Read:
    request: Request
    blocks: list  # local blocks being written (referenced until the read ends)
    hashes: list[bytes]
    handle: Any
    peer: str
    deadline: float
    aborted: bool = False


class KVTransfer:
    def __init__(self, config: KVTransferConfig, runner: Any, kv_cache: Any,
                 layout_key: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError:
            raise ValueError("--kv-transfer-config needs NIXL: pip install "
                             "'tokenmill[disagg]'.") from None
        self.config, self.kv_cache, self.layout_key = config, kv_cache, layout_key
        self.secret = config.secret
        self.block_size = kv_cache.block_size
        self.name = f"tokenmill-{uuid.uuid4().hex[:16]}"
        # (not NIXL's progress thread: it spins a core, which halves a CPU engine's speed;
        # `_progress` below polls only while blocks are held or read)
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=config.backends,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        caches = cache_tensors(runner)
        if not all(t.is_contiguous() for t in caches):
            raise ValueError("--kv-transfer-config: this model's KV cache is not contiguous.")
        self._registered = self.agent.get_reg_descs(caches)
        self.agent.register_memory(self._registered)
        self.kind = "VRAM" if caches[0].device.type == "cuda" else "DRAM"
        self.device = caches[0].device.index or 0
        self.bases = np.array([t.data_ptr() for t in caches], dtype=np.uint64)
        self.widths = np.array([t[0].numel() * t.element_size() for t in caches],
                               dtype=np.uint64)
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.held: dict[str, tuple[list, float]] = {}  # transfer id -> (blocks, until)
        self.reads: dict[str, _Read] = {}  # request id -> its read in flight
        self.refused: list[tuple[Request, str, int]] = []
        self.peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.num_read_blocks = self.num_failed = 0
        self._notified: collections.deque[str] = collections.deque()  # transfer ids read
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._progress, name="kv-transfer",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, config: Any, core: Any) -> KVTransfer | None:
        """The connector an EngineCore `core` asks for (None: no --kv-transfer-config)."""
        if config.kv_transfer_config is None:
            return None
        from tokenmill.engine.kv_offload_tier import model_key

        transfer = cls(config.kv_transfer_config, core.runner, core.kv_cache,
                       layout_key(model_key(config, core)))
        logger.info("KV transfer: NIXL agent %s (%s) over %d cache tensors", transfer.name,
                    config.kv_transfer_config.kv_role, len(transfer.bases))
        return transfer

    def _progress(self) -> None:
        """UCX's progress, every millisecond while this side holds blocks for a reader or
        reads (the other side of a read over TCP needs it too), and the notifications of
        reads done."""
        while not self._stop:
            if not (self.held or self.reads):
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            for messages in self.agent.get_new_notifs().values():
                self._notified.extend(m[len(DONE):].decode(errors="replace")
                                      for m in messages if m.startswith(DONE))
            time.sleep(0.001)

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept for decode instances' reads."""
        return sum(len(blocks) for blocks, _ in self.held.values())

    @property
    def pending(self) -> bool:
        """Reads in flight, or refusals not yet answered."""
        return bool(self.reads or self.refused)

    # ---- prefill side -----------------------------------------------------------------
    def hold(self, request: Request) -> dict | None:
        """The `kv_transfer_params` a finished prefill request answers with (None: it asked
        none, or did not finish normally); its full prompt blocks stay referenced."""
        params = request.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return None
        pool, blocks = self.kv_cache.pool, []
        for block_hash in request.block_hashes[:(request.num_prompt_tokens - 1)
                                               // self.block_size]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        transfer_id = uuid.uuid4().hex
        if blocks:
            pool.touch(blocks)
            self.held[transfer_id] = (blocks, time.monotonic() + self.config.hold_seconds)
            self._wake.set()
        out = {"do_remote_prefill": True, "remote_engine_id": self.name,
               "remote_request_id": transfer_id, "remote_agent_metadata": self.metadata,
               "kv_layout": self.layout_key,
               "last_block_hash": blocks[-1].block_hash.hex() if blocks else "none",
               "remote_block_ids": [b.block_id for b in blocks],
               "remote_cache_addrs": [int(a) for a in self.bases],
               "expires_at": time.time() + self.config.hold_seconds}
        if self.secret is not None:
            out["signature"] = self._sign(out)
        return {**out, "do_remote_decode": False}

    def after_step(self) -> None:
        """After a step: blocks whose decode side notified, or whose hold ran out, go back."""
        while self._notified:
            self._release(self._notified.popleft())
        if not self.held:
            return
        now = time.monotonic()
        for transfer_id in [t for t, (_, until) in self.held.items() if until < now]:
            self._release(transfer_id)

    def _release(self, transfer_id: str) -> None:
        held = self.held.pop(transfer_id, None)
        if held is not None:
            self.kv_cache.pool.free_blocks(reversed(held[0]))

    def _sign(self, params: dict) -> str:
        return hmac.new(self.secret, signed_text(params), hashlib.sha256).hexdigest()

    # ---- decode side ------------------------------------------------------------------
    def lookup(self, request: Request) -> bool:
        """Whether `request` waits for a read (or a refusal: `ready` hands both on)."""
        params = request.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return False
        try:
            return self._start(request, params)
        except TransferRefused as exc:
            self.num_failed += 1
            self.refused.append((request, str(exc), exc.status))
            return True

    def _start(self, request: Request, params: dict) -> bool:
        if self.secret is not None and not hmac.compare_digest(
                params.get("signature", ""), self._sign(params)):
            raise TransferRefused("kv_transfer_params are not signed by a prefill instance of "
                                  "this deployment.", 400)
        if params["kv_layout"] != self.layout_key or len(
                params["remote_cache_addrs"]) != len(self.bases):
            raise TransferRefused("The prefill instance serves another model or KV cache "
                                  "layout than this decode instance.", 400)
        if params["expires_at"] - time.time() < self.config.timeout_seconds:
            raise TransferRefused("The prefill instance's KV cache blocks for this request "
                                  "are released (its hold_seconds passed); prefill it again.")
        remote_ids = params["remote_block_ids"]
        hits, _ = self.kv_cache.get_computed_blocks(request)
        n = len(remote_ids)
        hashes = request.block_hashes
        if n and (n > len(hashes) or hashes[n - 1].hex() != params["last_block_hash"]):
            logger.warning("Request %s: its prompt is not the one prefilled; it is computed "
                           "here.", request.request_id)
            n = 0
        pool = self.kv_cache.pool
        count = min(n - len(hits), pool.num_free_blocks - sum(b.ref_cnt == 0 for b in hits))
        peer, done = params["remote_engine_id"], DONE + params["remote_request_id"].encode()
        if count <= 0:  # (nothing to read: the prefill side may let its blocks go)
            try:
                self._connect(peer, params["remote_agent_metadata"])
                self._notify(peer, done)
            except TransferRefused:
                pass
            return False
        self._connect(peer, params["remote_agent_metadata"])
        start = len(hits)
        pool.touch(hits)  # (not reused for the blocks read: they stay this request's hits)
        blocks = pool.get_new_blocks(count)
        pool.free_blocks(reversed(hits))
        local = self._descs(self.bases, [b.block_id for b in blocks])
        remote = self._descs(np.array(params["remote_cache_addrs"], dtype=np.uint64),
                             remote_ids[start:start + count])
        try:
            handle = self.agent.initialize_xfer("READ", local, remote, peer, done)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("the transfer could not be posted")
        except Exception as exc:  # noqa: BLE001 - NIXL's errors: the peer gone, mostly
            self.kv_cache.pool.free_blocks(reversed(blocks))
            self._disconnect(peer)
            raise TransferRefused(f"Reading the KV cache from the prefill instance failed "
                                  f"({type(exc).__name__}); retry the request.") from None
        self.reads[request.request_id] = _Read(
            request, blocks, hashes[start:start + count], handle, peer,
            time.monotonic() + self.config.timeout_seconds)
        self._wake.set()
        return True

    def _descs(self, bases: np.ndarray, block_ids: list[int]) -> Any:
        """One (address, length, device) row per cache tensor and block, caches outer."""
        ids = np.asarray(block_ids, dtype=np.uint64)
        if len(ids) and int(ids.max()) >= 2**40:
            raise TransferRefused("kv_transfer_params name blocks out of range.", 400)
        addrs = (bases[:, None] + ids[None, :] * self.widths[:, None]).ravel()
        rows = np.stack([addrs, np.repeat(self.widths, len(ids)),
                         np.full(len(addrs), self.device, dtype=np.uint64)], axis=1)
        return self.agent.get_xfer_descs(rows, self.kind)

    def _connect(self, peer: str, metadata: str) -> None:
        if peer in self.peers:
            self.peers.move_to_end(peer)
            return
        try:
            name = self.agent.add_remote_agent(base64.b64decode(metadata, validate=True))
        except Exception as exc:  # noqa: BLE001 - bad metadata, or the peer unreachable
            raise TransferRefused(f"The prefill instance cannot be reached "
                                  f"({type(exc).__name__}); retry the request.") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer:
            if name not in self.peers:  # (loaded just now for this: not kept)
                self._forget(name)
            raise TransferRefused("kv_transfer_params: remote_engine_id does not match its "
                                  "agent metadata.", 400)
        self.peers[peer] = None
        in_use = {r.peer for r in self.reads.values()}
        for old in [p for p in self.peers if p not in in_use][:len(self.peers) - MAX_PEERS]:
            self._disconnect(old)

    def _disconnect(self, peer: str) -> None:
        """Forgets `peer` (gone, or its parameters were bad) unless a read from it is in
        flight; its next parameters connect again."""
        if any(read.peer == peer for read in self.reads.values()):
            return
        if self.peers.pop(peer, 0) is None:
            self._forget(peer)

    def _forget(self, peer: str) -> None:
        with contextlib.suppress(Exception):  # (already gone)
            self.agent.remove_remote_agent(peer)

    def _notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception:  # noqa: BLE001 - its hold runs out instead
            logger.debug("KV transfer: notifying %s failed", peer)

    def ready(self, timeout: float = 0.0) -> tuple[list[Request], list[tuple[Request, str, int]]]:
        """(requests whose reads finished, their blocks in the prefix cache now; requests
        refused, with the message and status), waiting up to `timeout` s for one."""
        until = time.monotonic() + timeout
        done: list[Request] = []
        while True:
            for request_id, read in list(self.reads.items()):
                state = self.agent.check_xfer_state(read.handle)
                if state == "PROC" and time.monotonic() < read.deadline:
                    continue
                del self.reads[request_id]
                if self._finish(read, state) and not read.aborted:
                    done.append(read.request)
            refused, self.refused = self.refused, []
            if done or refused or not self.reads or time.monotonic() >= until:
                return done, refused
            time.sleep(0.001)

    def _finish(self, read: _Read, state: str) -> bool:
        pool = self.kv_cache.pool
        try:
            self.agent.release_xfer_handle(read.handle)
        except Exception:  # noqa: BLE001 - still writing: its blocks are never reused
            logger.error("KV transfer: a read that %s could not be cancelled; its %d blocks "
                         "stay out of use.", "failed" if state == "ERR" else "timed out",
                         len(read.blocks))
            state = "LOST"
        if state == "DONE":
            for block, block_hash in zip(read.blocks, read.hashes):
                pool.cache_full_block(block, block_hash)
            self.num_read_blocks += len(read.blocks)
        if state != "LOST":
            pool.free_blocks(reversed(read.blocks))
        if state == "DONE":
            return True
        self.num_failed += 1
        if state == "ERR":
            self._disconnect(read.peer)
        if not read.aborted:
            self.refused.append((read.request, "Reading the KV cache from the prefill "
                                 "instance " + ("failed (it is gone?)" if state == "ERR"
                                                else "timed out") + "; retry the request.", 503))
        return False

    def drop(self, request_ids: list[str]) -> None:
        """Aborted while their blocks were read: the read finishes, the request is forgotten."""
        for request_id in request_ids:
            read = self.reads.get(request_id)
            if read is not None:
                read.aborted = True
        self.refused = [r for r in self.refused if r[0].request_id not in request_ids]

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(5)
        registered, self._registered = self._registered, None
        if registered is not None:
            with contextlib.suppress(Exception):  # (the process ends anyway)
                self.agent.deregister_memory(registered)


def layout_key(model_key: dict) -> str:
    """What two engines' blocks must share to be copied between them: the model's config,
    dtypes, quantization, block size and cache layout (not its files' names or times)."""
    same = {k: v for k, v in model_key.items() if k != "files"}
    return hashlib.sha256(repr(sorted(same.items())).encode()).hexdigest()[:32]
