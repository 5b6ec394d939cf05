"""Calibration for activation quantization (a8w8 smoothing and static ranges, static fp8):
read a local text or JSONL file, run it through the model, record what each linear layer sees."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class ActivationStats:
    """Per input channel of one linear layer, over every calibration token."""

    absmax: torch.Tensor  # [K] max |x|
    low: torch.Tensor  # [K] min x
    high: torch.Tensor  # [K] max x

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1, x.shape[-1])
        torch.maximum(self.absmax, x.abs().amax(0), out=self.absmax)
        torch.minimum(self.low, x.amin(0), out=self.low)
        torch.maximum(self.high, x.amax(0), out=self.high)

    @classmethod
    def empty(cls, k: int, device: torch.device) -> ActivationStats:
        return cls(torch.zeros(k, device=device), torch.full((k,), float("inf"), device=device),
                   torch.full((k,), float("-inf"), device=device))


def read_calibration_text(path: str) -> str:
    """A .jsonl file: one JSON string or object per line (its "text", "prompt" or "content");
    anything else: the file as plain text."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return f.read()
        parts = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not a JSON line.") from None
            if isinstance(item, dict):
                item = next((item[k] for k in ("text", "prompt", "content") if k in item), None)
            if not isinstance(item, str):
                raise ValueError(f"{path}:{number}: expected a string or an object with "
                                 "\"text\".")
            parts.append(item)
        return "\n\n".join(parts)


def calibration_samples(text: str, tokenizer: Any, num_samples: int,
                        seq_len: int) -> list[list[int]]:
    """Cut the tokenized text into up to `num_samples` chunks of `seq_len` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 16:
        raise ValueError(f"The calibration text has only {len(ids)} tokens; give at least a "
                         "few sentences.")
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    return [c for c in chunks if len(c) >= 16][:num_samples]


def record_activations(model: nn.Module, names: list[str]) -> tuple[dict[str, ActivationStats],
                                                                    list[Any]]:
    """Hooks that update each named layer's input statistics on every forward; remove the
    returned handles when done."""
    modules = dict(model.named_modules())
    stats: dict[str, ActivationStats] = {}
    handles = []
    for name in names:
        def hook(module, args, name=name):
            x = args[0]
            if name not in stats:
                stats[name] = ActivationStats.empty(x.shape[-1], x.device)
            stats[name].update(x)
        handles.append(modules[name].register_forward_pre_hook(hook))
    return stats, handles
