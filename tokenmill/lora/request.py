"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields). No torch: the
API processes and the engine's messages carry it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter by name, a positive integer id (unique among the adapters served) and its
    folder (`adapter_config.json` + `adapter_model.safetensors`, as `peft` saves them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str):
            raise ValueError("lora_path must be a string.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """What the prefix cache keys this adapter's blocks by: the same prompt under two
        adapters (or an adapter and the base) never shares KV."""
        return f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()


def served_adapters(modules: list[tuple[str, str, str | None]] | None) -> dict[str, LoRARequest]:
    """The adapters of --lora-modules by name, ids 1.. in their order (every process builds
    the same table from the same configuration)."""
    return {name: LoRARequest(name, i + 1, path)
            for i, (name, path, _) in enumerate(modules or ())}
