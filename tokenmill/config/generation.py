"""Default sampling parameters from a model's `generation_config.json`, as vLLM applies them
(`--generation-config auto|vllm|FOLDER`, `--override-generation-config JSON`): an OpenAI
request's unset temperature / top_p / top_k / min_p / repetition_penalty take the model
creator's values (DeepSeek-R1: temperature 0.6, top_p 0.95), its `max_new_tokens` caps every
request's max_tokens, and they are the offline `LLM`'s default `SamplingParams`."""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from tokenmill.config.json_flag import json_object
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the file's fields read, by their SamplingParams names
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def checked(setting: str, override: dict | str | None) -> dict | None:
    """What `EngineConfig` checks before anything loads (the file is read later); returns
    the override as a dict (given as one or as its JSON text)."""
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"generation_config.json, got {setting!r}.")
    override = json_object(override, "--override-generation-config",
                           example="'{\"temperature\": 0.5}'")
    if override is None:
        return None
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config has unknown field(s) "
                         f"{', '.join(unknown)}; it takes {', '.join(FIELDS)}.")
    return override


def sampling_defaults(model_path: str, setting: str = "auto",
                      override: dict | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments: the generation config's sampling fields that are set
    (`setting` "auto": the model folder's file, none if it has none; "vllm": none; else the
    file in that folder), `override`'s fields over them. A bad value is named, with its file."""
    found: dict[str, Any] = {}
    path = None
    if setting != "vllm":
        folder = model_path if setting == "auto" else setting
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    found = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{path} is not readable JSON ({exc}).") from None
            if not isinstance(found, dict):
                raise ValueError(f"{path} must hold a JSON object.")
        elif setting != "auto":
            raise ValueError(f"--generation-config {setting!r}: no generation_config.json "
                             f"there (give 'auto', 'vllm' or a folder holding one).")
    defaults = {}
    for source, config in ((path, found), ("--override-generation-config", override or {})):
        for name, ours in FIELDS.items():
            value = config.get(name)
            if value is None:
                continue
            try:
                SamplingParams(**{ours: value})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: {name} {value!r} is not a usable sampling "
                                 f"default ({exc})") from None
            defaults[ours] = value
    return defaults


def copy_file(model_path: str, out: str) -> None:
    """The model's generation_config.json (its sampling defaults, its extra EOS ids) into a
    folder written from the model (`tokenmill quantize`), if it has one."""
    source = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(out, "generation_config.json"))


def log_defaults(defaults: dict[str, Any]) -> None:
    if defaults:
        logger.info("Default sampling parameters from the model's generation config: %s "
                    "(requests' own values win; --generation-config vllm turns them off).",
                    defaults)
