"""`LoRAManager`: a rank's adapters. Up to `max_cpu_loras` are kept read and checked in host
memory (least recently used dropped first); the `max_loras` slots hold the ones a step runs,
copied into each targeted layer's slot tensors. The scheduler never puts more adapters in a
step than there are slots."""

from __future__ import annotations

import collections
import concurrent.futures
import logging

import numpy as np
import torch
from torch import nn

from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from tokenmill.lora.layers import EmbeddingLoRA, LoRABatch, LoRALayer
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.batch = LoRABatch()  # the step's token rows
        self.logits_batch = LoRABatch()  # the rows the LM head gets next (`logits_rows`)
        # built for a layer when an adapter targets it
        self.layers: dict[str, LoRALayer | EmbeddingLoRA] = {}
        self._modules = dict(model.named_modules())
        self.cpu: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self._slot_use = [0] * max_loras  # step count of each slot's last use (LRU)
        # reads begun ahead of the step that needs them (other ranks: `prefetch`)
        self._reading: dict[int, tuple[LoRARequest, concurrent.futures.Future]] = {}
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._announced: list[LoRARequest] = []
        self._steps = 0

    # ---- adapters in host memory --------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter read and checked (LoRAError if refused), kept in host memory."""
        held = self.cpu.get(request.lora_int_id)
        if held is not None and held.request == request:
            self.cpu.move_to_end(request.lora_int_id)
            return held
        reading = self._reading.pop(request.lora_int_id, None)
        if reading is not None and reading[0] == request:
            return self.keep(reading[1].result())  # (begun by `prefetch`: its rest waited)
        return self.keep(self.read(request))

    def announce(self, request: LoRARequest) -> None:
        """Rank 0 began reading `request`'s adapter off its step loop: the next step's
        inputs tell the other ranks (`take_announced`), which begin theirs (`prefetch`)."""
        self._announced.append(request)

    def take_announced(self) -> list[LoRARequest]:
        announced, self._announced = self._announced, []
        return announced

    def prefetch(self, requests: list[LoRARequest]) -> None:
        """Begin reading adapters not in host memory on a thread (`add` takes them)."""
        for request in requests:
            if self.holds(request) or request.lora_int_id in self._reading:
                continue
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tokenmill-lora-prefetch")
            self._reading[request.lora_int_id] = (request,
                                                  self._reader.submit(self.read, request))

    def holds(self, request: LoRARequest) -> bool:
        held = self.cpu.get(request.lora_int_id)
        return held is not None and held.request == request

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter read from its folder and checked against the model (LoRAError if
        refused); nothing kept: safe off the engine's thread."""
        return load_adapter(request, self.model, self.max_rank, self.dtype,
                            torch.device("cpu"))

    def keep(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """A read adapter kept in host memory (the least recently used past
        --max-cpu-loras dropped)."""
        request = adapter.request
        if self.holds(request):  # (read twice meanwhile: the first copy stays)
            self.cpu.move_to_end(request.lora_int_id)
            return self.cpu[request.lora_int_id]
        if request.lora_int_id in self.cpu:  # (the same id for another adapter: replaced)
            self.remove(request.lora_int_id)
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            dropped, _ = self.cpu.popitem(last=False)
            logger.info("LoRA adapter %d left host memory (--max-cpu-loras %d)", dropped,
                        self.max_cpu_loras)
        logger.info("LoRA adapter %r (id %d) loaded: rank %d, %d layers, %.1f MiB",
                    request.lora_name, request.lora_int_id, adapter.rank, len(adapter.layers),
                    adapter.num_bytes / 2**20)
        return adapter

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot freed too); whether it was held."""
        held = self.cpu.pop(lora_id, None) is not None
        for slot, owner in enumerate(self.slots):
            if owner == lora_id:
                for layer in self.layers.values():
                    layer.set_slot(slot, None)
                self.slots[slot] = None
                held = True
        return held

    def list(self) -> list[int]:
        return list(self.cpu)

    # ---- one step -------------------------------------------------------------------------
    def prepare(self, lora_ids: list[int], requests: list[LoRARequest],
                rows_per_seq: list[int]) -> None:
        """The step's rows mapped to slots: `lora_ids` per sequence (0: the base model),
        `requests` the adapters among them (read from their folders where not held)."""
        self._steps += 1
        if not any(lora_ids):
            self.batch.clear()
            return
        wanted = {r.lora_int_id: r for r in requests}
        slot_of = {}
        for lora_id in dict.fromkeys(i for i in lora_ids if i):
            slot_of[lora_id] = self._slot(wanted[lora_id], set(slot_of.values()))
        slots = np.array([slot_of.get(i, -1) for i in lora_ids], dtype=np.int64)
        self.batch.set(np.repeat(slots, rows_per_seq), self.device)

    def logits_rows(self, rows: np.ndarray | None) -> None:
        """The step's token rows whose hidden states the LM head is given next, in order
        (None: rows of no step, such as a draft head's: the base model's head)."""
        if rows is None or not self.batch.active:
            self.logits_batch.clear()
        else:
            self.logits_batch.set(self.batch.slot_of_row[rows], self.device)

    def _slot(self, request: LoRARequest, taken: set[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s in range(self.max_loras) if s not in taken]
            if not free:
                raise LoRAError(f"A step holds more adapters than --max-loras "
                                f"({self.max_loras}).")
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_use[s]))
            self._fill(slot, self.add(request))
        self._slot_use[slot] = self._steps
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for name in adapter.layers:
            if name not in self.layers:
                layer = self._modules[name]
                with torch.inference_mode():
                    if isinstance(layer, VocabParallelEmbedding):
                        made = EmbeddingLoRA(layer, self.batch, self.max_loras, self.max_rank,
                                             self.dtype, self.device)
                    else:  # (an LM head's rows are the sampled ones: a batch of their own)
                        assert isinstance(layer, Linear)
                        batch = self.logits_batch if isinstance(layer, ParallelLMHead) \
                            else self.batch
                        made = LoRALayer(layer, batch, self.max_loras, self.max_rank,
                                         self.dtype, self.device)
                    self.layers[name] = layer.lora = made
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.layers.get(name))
        self.slots[slot] = adapter.request.lora_int_id
