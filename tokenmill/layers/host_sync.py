"""`HostSync`: declared by modules whose forward may wait on the host (MoE's per-expert loop,
latent attention's per-sequence torch ops), so that a step holding one runs eagerly rather
than as a CUDA graph; `waits_on_host` asks it of a whole model or layer."""

from __future__ import annotations

from torch import nn


class HostSync:
    """Mixin: `host_sync` says whether this module's forward waits on the host now."""

    @property
    def host_sync(self) -> bool:
        return True


def waits_on_host(*modules: nn.Module) -> bool:
    return any(isinstance(m, HostSync) and m.host_sync
               for module in modules for m in module.modules())
