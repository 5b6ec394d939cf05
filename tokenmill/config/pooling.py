"""`PoolerConfig`: how a pooling model (`--runner pooling`: embeddings, scores) turns its
final hidden states into one vector per input, resolved once at start-up from the model
folder (a sentence-transformers `modules.json` and its `1_Pooling` / `2_Dense` /
`Normalize` modules, or a `*ForSequenceClassification` head), then `--pooler-config`.

vLLM's names: `--runner auto|generate|pooling`, `--task embed|classify|score|...` (its
older spelling of the runner), `--pooler-config '{"pooling_type": "MEAN", "normalize":
true}'`; pooling types LAST, MEAN, CLS, MAX."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from tokenmill.config.json_flag import json_object

RUNNERS = ("auto", "generate", "pooling")
# vLLM's --task values: the runner each one means (score and reward are pooling tasks)
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
         "classify": "pooling", "score": "pooling", "reward": "pooling"}
POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX")
# sentence-transformers' pooling modes -> ours
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "max": "MAX"}
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Tanh": "tanh",
                   "torch.nn.modules.activation.Sigmoid": "sigmoid"}
_CLASSIFY_SUFFIX = "ForSequenceClassification"
# what the sentence-transformers modules of a folder are called (any version)
_ST_MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize",
               "Dense": "dense"}


class DenseLayer(msgspec.Struct, frozen=True):
    """A sentence-transformers `Dense` module after pooling: its folder (weights inside),
    sizes and activation."""

    path: str
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "identity"  # identity | tanh | sigmoid


class PoolerConfig(msgspec.Struct, frozen=True):
    """`task`: embed (a vector per input) or classify (`num_labels` scores from the
    checkpoint's `score` / `classifier` head; a cross-encoder's relevance when 1).
    `normalize`: embeddings unit length by default (a request may say otherwise)."""

    task: str = "embed"
    pooling_type: str = "LAST"
    normalize: bool = True
    dense: list[DenseLayer] = []
    num_labels: int = 0
    head: str = ""  # classify: the checkpoint tensor prefix of the head ("score")
    hidden_size: int = 0
    labels: list[str] = []  # classify: each label's name (config.json's id2label)

    @property
    def dimensions(self) -> int:
        """The length of an embedding."""
        return self.dense[-1].out_features if self.dense else self.hidden_size

    def check(self, params: Any) -> None:
        """A request's PoolingParams against this model (ValueError: refused, why)."""
        if params.task != self.task:
            what = ("an embedding model: ask for embeddings" if self.task == "embed" else
                    "a classifier: ask for scores or classes")
            raise ValueError(f"This model is {what}, not task {params.task!r}.")
        if params.dimensions is not None and params.dimensions > self.dimensions:
            raise ValueError(f"dimensions must be at most the model's {self.dimensions}, got "
                             f"{params.dimensions}.")


def runner_of(runner: str | None, task: str | None) -> str:
    """--runner, or what vLLM's --task means (they must agree when both are given)."""
    implied = TASKS[task] if task is not None else None
    if runner is not None and implied not in (None, "auto", runner):
        raise ValueError(f"--task {task} asks for the {implied} runner, --runner says {runner}.")
    return runner or implied or "auto"


def wants_pooling(runner: str, hf_config: Any, path: str) -> bool:
    """`--runner auto`: a folder saved by sentence-transformers, or an architecture that is
    a bare decoder (`LlamaModel`) or a sequence classifier, is served as a pooling model."""
    if runner != "auto":
        return runner == "pooling"
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return (arch.endswith(_CLASSIFY_SUFFIX) or arch.endswith("Model")
            or os.path.isfile(os.path.join(path, "modules.json")))


def resolve_pooler(path: str, hf_config: Any, override: dict | None = None) -> PoolerConfig:
    """The pooler of the model at `path` (ValueError: a module or field it cannot serve)."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    fields: dict[str, Any] = {"hidden_size": int(hf_config.hidden_size)}
    if arch.endswith(_CLASSIFY_SUFFIX):
        # transformers' *ForSequenceClassification: the last token's state through `score`
        labels = int(getattr(hf_config, "num_labels", 0) or 2)
        names = getattr(hf_config, "id2label", None) or {}
        fields.update(task="classify", pooling_type="LAST", normalize=False, head="score",
                      num_labels=labels,
                      labels=[str(names.get(i, f"LABEL_{i}")) for i in range(labels)])
    elif os.path.isfile(os.path.join(path, "modules.json")):
        fields.update(_sentence_transformers(path))
    else:
        fields.update(pooling_type="LAST", normalize=True)  # (vLLM's default for decoders)
    for key, value in (override or {}).items():
        if key == "pooling_type":
            value = str(value).upper()
            if value not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type must be one of "
                                 f"{', '.join(POOLING_TYPES)}, got {value!r}.")
        elif key == "normalize":
            value = bool(value)
        else:
            raise ValueError(f"pooler_config takes pooling_type and normalize, not {key!r}.")
        fields[key] = value
    return PoolerConfig(**fields)


def parse_override(value: dict | str | None) -> dict | None:
    """`--pooler-config`: a dict or its JSON text."""
    return json_object(value, "--pooler-config")


def _sentence_transformers(path: str) -> dict[str, Any]:
    """Our fields from a sentence-transformers folder's modules, in their order."""
    modules = _read_json(os.path.join(path, "modules.json"))
    if not isinstance(modules, list):
        raise ValueError(f"{path}/modules.json is not a list of modules.")
    fields: dict[str, Any] = {"normalize": False, "dense": []}
    for module in modules:
        kind = _ST_MODULES.get(str(module.get("type", "")).rsplit(".", 1)[-1])
        folder = os.path.join(path, str(module.get("path", "")))
        if os.path.commonpath([os.path.realpath(folder), os.path.realpath(path)]) != \
                os.path.realpath(path):
            raise ValueError(f"{path}/modules.json names a folder outside the model.")
        if kind == "pooling":
            fields["pooling_type"] = _pooling_type(_read_json(os.path.join(folder,
                                                                          "config.json")))
        elif kind == "normalize":
            fields["normalize"] = True
        elif kind == "dense":
            fields["dense"].append(_dense(folder))
        elif kind != "transformer":
            raise ValueError(f"sentence-transformers module {module.get('type')!r} is not "
                             "served (Transformer, Pooling, Dense and Normalize are).")
    if "pooling_type" not in fields:
        raise ValueError(f"{path}/modules.json has no Pooling module.")
    return fields


def _pooling_type(config: dict) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # (the older spelling: one boolean per mode)
        modes = [name.removeprefix("pooling_mode_").removesuffix("_token").removesuffix(
            "_tokens") for name, on in config.items() if name.startswith("pooling_mode_") and on]
        mode = modes if len(modes) != 1 else modes[0]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in _ST_MODES:
        raise ValueError(f"Pooling mode {mode!r} is not served (lasttoken, mean, cls and max "
                         "are).")
    if config.get("include_prompt", True) is False:
        raise ValueError("Pooling with include_prompt false is not served.")
    return _ST_MODES[mode]


def _dense(folder: str) -> DenseLayer:
    config = _read_json(os.path.join(folder, "config.json"))
    activation = config.get("activation_function") or "torch.nn.modules.linear.Identity"
    if activation not in _ST_ACTIVATIONS:
        raise ValueError(f"Dense activation {activation!r} is not served (Identity, Tanh and "
                         "Sigmoid are).")
    return DenseLayer(folder, int(config["in_features"]), int(config["out_features"]),
                      bool(config.get("bias", True)), _ST_ACTIVATIONS[activation])


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read {file}: {exc}") from None
