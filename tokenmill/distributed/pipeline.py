"""Pipeline-parallel hand-offs of one rank, with several micro-batches in flight.

Each step's inputs reach stage 0's ranks by a broadcast in their tensor-parallel group; every
rank of stage s then sends the step's input bytes, hidden states and residual to its peer of
stage s + 1 (the same tensor-parallel rank), and the last stage's logits go back to rank 0.
With draft heads (MTP, EAGLE), which run on stage 0, what head 0 reads of each step (the final
hidden states, or the states entering an EAGLE-3 head's layers, carried along the stages) goes
back from each last-stage rank to its stage-0 peer with the logits.
Sends start without waiting (a rank goes on to its next micro-batch while its peer is still
busy) and a rank waits for its previous sends only before its next ones: at most one
micro-batch travels on each link, so messages pair up in order. Every stage runs the
micro-batches in the order rank 0 launched them, so a KV block freed and handed to another
request while an older micro-batch still uses it is written by the older one first on every
stage. Rank 0 posts the receive of a micro-batch's logits when it launches it, tagged by
the micro-batch's number (every rank counts the micro-batches it runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.distributed.parallel_state import World

_TAGS = 2**20  # logits tags cycle through 1 .. _TAGS (0 tags the stage-to-stage link)


@dataclass
class PendingLogits:
    """A micro-batch's logits on their way from the last stage to rank 0."""

    tensors: list[torch.Tensor]
    works: list[Any]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.tensors


class StageLink:
    def __init__(self, world: World, device: torch.device) -> None:
        self.world, self.device = world, device
        self._sends: list[tuple[list[Any], list[torch.Tensor]]] = []  # not yet waited on
        self._batches = 0  # micro-batches this rank has run (or, on rank 0, launched)

    def next_tag(self) -> int:
        self._batches += 1
        return 1 + self._batches % _TAGS

    def _send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        self.drain()
        tensors = [t.contiguous() for t in tensors]
        self._sends.append((self.world.isend(tensors, dst, tag), tensors))

    def drain(self) -> None:
        """Wait until this rank's sends are received."""
        sends, self._sends = self._sends, []
        for works, _ in sends:
            for work in works:
                work.wait()

    def to_next(self, data: bytes, hidden: torch.Tensor, residual: torch.Tensor,
                extra: list[torch.Tensor] = ()) -> None:
        """The step's bytes, hidden states and residual (and `extra` states of its rows) to
        the next stage's peer."""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._send([length, payload, hidden, residual, *extra],
                   self.world.peer(self.world.stage + 1), 0)

    def stop_next(self) -> None:
        """Tell the next stage's peer to stop (after every micro-batch sent is received)."""
        if not self.world.is_last_stage:
            self._send([torch.zeros(1, dtype=torch.int64, device=self.device)],
                       self.world.peer(self.world.stage + 1), 0)
        self.drain()

    def from_prev(self) -> bytes:
        """The next step's input bytes from the previous stage (b"": stop)."""
        prev = self.world.peer(self.world.stage - 1)
        length = self.world.recv([torch.empty(1, dtype=torch.int64, device=self.device)],
                                 prev)[0].item()
        if not length:
            return b""
        payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        return self.world.recv([payload], prev)[0].cpu().numpy().tobytes()

    def intermediate_from_prev(self, rows: int, hidden_size: int, dtype: torch.dtype,
                               extra: int = 0
                               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The previous stage's hidden states and residual of this step's `rows` tokens, and
        the `extra` states it carried on."""
        tensors = [torch.empty(rows, hidden_size, dtype=dtype, device=self.device)
                   for _ in range(2 + extra)]
        self.world.recv(tensors, self.world.peer(self.world.stage - 1))
        return tensors[0], tensors[1], tensors[2:]

    def to_first(self, logits: list[torch.Tensor], hidden_states: list[torch.Tensor],
                 tag: int) -> None:
        """The last stage's logits (sampled rows, then prompt-logprob ranges: rank 0 of its
        tensor-parallel group only) and what draft heads read (every rank) to stage 0."""
        tensors = (logits if self.world.rank % self.world.tp_size == 0 else []) + hidden_states
        if tensors:
            self._send(tensors, self.world.peer(0), tag)

    def expect(self, shapes: list[tuple[int, int]], dtype: torch.dtype,
               tag: int) -> PendingLogits:
        """Stage 0: post the receive of what `to_first` sends of a micro-batch."""
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape in shapes]
        last = self.world.peer(self.world.pp_size - 1)
        return PendingLogits(tensors, self.world.irecv(tensors, last, tag))
