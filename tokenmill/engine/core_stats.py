"""`core_stats`: an engine core's gauges and counters as the `SchedulerStats` it sends with
every batch of outputs and every heartbeat."""

from __future__ import annotations

from typing import Any

from tokenmill.engine.protocol import SchedulerStats


def core_stats(core: Any) -> SchedulerStats:
    """`core`: an EngineCore."""
    kv, scheduler = core.kv_cache, core.scheduler
    return SchedulerStats(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        kv_blocks_used=kv.pool.num_used_blocks, kv_blocks_total=kv.num_blocks,
        prefix_queried_tokens=kv.num_queried_tokens, prefix_hit_tokens=kv.num_hit_tokens,
        num_preemptions=scheduler.num_preemptions,
        spec_draft_tokens=scheduler.num_draft_tokens,
        spec_accepted_tokens=scheduler.num_accepted_tokens,
        spec_emitted_tokens=scheduler.num_spec_emitted,
        spec_steps=scheduler.num_spec_steps, sleeping=core.sleeping,
        num_admitted=scheduler.num_admitted, **_lora_stats(core), **_disk_stats(core),
        **_transfer_stats(core))


def _transfer_stats(core: Any) -> dict:
    transfer = core.kv_transfer
    return {} if transfer is None else {"kv_transfer_read_blocks": transfer.num_read_blocks,
                                        "kv_transfer_failed": transfer.num_failed}


def _disk_stats(core: Any) -> dict:
    tier = core.offload_tier
    if tier is None:
        return {}
    out = {}
    if tier.disk is not None:
        disk = tier.disk
        out.update(kv_disk_read_blocks=disk.num_loaded, kv_disk_written_blocks=disk.num_saved,
                   kv_disk_rejected_blocks=disk.num_rejected,
                   kv_disk_dropped_blocks=disk.num_failed + tier.num_dropped * (
                       tier.host is None))
    if tier.host is not None:
        host = tier.host
        out.update(kv_host_read_blocks=host.num_loaded, kv_host_written_blocks=host.num_saved,
                   kv_host_evicted_blocks=host.num_evicted,
                   kv_host_dropped_blocks=tier.num_dropped)
    return out


def _lora_stats(core: Any) -> dict:
    if core.runner.lora is None:
        return {}

    def names(requests) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests
                       if r.lora_request is not None})

    return {"loras": core.loras.served(), "running_loras": names(core.scheduler.running),
            "waiting_loras": names(core.scheduler.waiting), "max_loras": core.config.max_loras}
