"""The engine core's control requests (protocol.ControlRequest: sleep mode, weight updates,
a trainer's weight-update group), from the engine-core process's socket and from the offline
`LLM` alike, to engine/sleep_mode.py and engine/weight_sync.py."""

from __future__ import annotations

from typing import Any

from tokenmill.engine import sleep_mode

_GROUP_ACTIONS = {"init_weights_update_group": "init_group",
                  "update_weights_from_distributed": "update_from_group",
                  "destroy_weights_update_group": "close_group"}


def control(core: Any, action: str, level: int = 0, path: str = "",
            options: dict | None = None) -> None:
    """Runs one control request on `core`; a ValueError says why it was refused."""
    if action == "sleep":
        sleep_mode.sleep(core, level)
    elif action == "wake_up":
        sleep_mode.wake_up(core)
    elif action == "update_weights":
        sleep_mode.update_weights(core, path)
    elif action in _GROUP_ACTIONS:
        from tokenmill.engine import weight_sync  # (torch.distributed: only when asked)

        getattr(weight_sync, _GROUP_ACTIONS[action])(core, options or {})
    else:
        raise ValueError(f"Unknown engine control {action!r}.")
