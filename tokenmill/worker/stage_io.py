"""What one rank exchanges with the others around a step: the step message (rank 0 encodes it
and broadcasts it over its tensor-parallel group; a later pipeline stage takes it from the
stage before, then broadcasts it over its own), the async-scheduled input ids rank 0 alone
holds, and the stop. The pipeline's tensor hand-offs are `link` (distributed/pipeline.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tokenmill.core.scheduler import ScheduledRequest
from tokenmill.distributed.pipeline import StageLink
from tokenmill.worker.step_inputs import StepInputs
from tokenmill.worker.step_sync import StepReceiver, StepSender


class StageIO:
    def __init__(self, world, tp, device: torch.device) -> None:
        self.world, self.tp = world, tp
        # the step messages' block tables, kept in step across ranks
        self.steps = StepSender() if world.rank == 0 else StepReceiver()
        # pipeline parallel: the hand-offs between stages
        self.link = StageLink(world, device) if world.pp_size > 1 else None

    def send(self, inputs: StepInputs, scheduled: list[ScheduledRequest],
             finished: Iterable[str]) -> bytes:
        """Rank 0: the step's message to every other rank (b"" with none); `finished`: the
        requests whose block rows the others drop."""
        data = b""
        if self.world.size > 1:
            self.steps.release(finished)
            data = self.steps.encode(inputs, scheduled)
        self.tp.broadcast_bytes(data)
        return data

    def release(self, finished: Iterable[str]) -> None:
        """Rank 0, a step with nothing to run: the finished requests' rows dropped still."""
        if self.world.size > 1:
            self.steps.release(finished)

    def receive(self) -> bytes:
        """Another rank: the next message (b"": stop, passed on down the pipeline)."""
        data = (self.tp.broadcast_bytes(None) if self.world.is_first_stage
                else self.link.from_prev())
        if not data and self.link is not None:
            self.link.stop_next()
        return data

    def decode(self, data: bytes) -> StepInputs:
        return self.steps.decode(data)

    def stop(self) -> None:
        """Rank 0: every other rank's `ModelRunner.serve_steps` returns."""
        if self.world.size > 1 and self.world.rank == 0:
            self.tp.broadcast_bytes(b"")
            if self.link is not None:
                self.link.stop_next()

    def shared_fill(self, fill: Callable[[torch.Tensor], None] | None):
        """Asynchronous scheduling over tensor-parallel ranks: only rank 0 holds the tokens
        its previous step sampled, still on the device; every rank takes its step's input
        ids, filled (`fill`, rank 0), from there by one broadcast on the device's stream."""
        if self.tp.size == 1:
            return fill

        def fill_and_share(input_ids: torch.Tensor) -> None:
            if fill is not None:
                fill(input_ids)
            self.tp.broadcast(input_ids)
        return fill_and_share
