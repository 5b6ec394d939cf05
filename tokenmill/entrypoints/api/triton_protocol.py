"""Triton's generate fields (TensorRT-LLM's `ensemble` inputs), transport-free: checked and
mapped to `SamplingParams` (and beam search), and the outputs' logprob and performance
fields. HTTP (http/triton_api.py) and gRPC (kserve/) share them."""

from __future__ import annotations

import json
import math
from typing import Any

from tokenmill.beam_search import BeamSearchParams
from tokenmill.core.limits import context_overflow
from tokenmill.entrypoints.api import defaults
from tokenmill.entrypoints.api.lora_tensors import task_name
from tokenmill.entrypoints.api.openai_protocol import CAPS
from tokenmill.entrypoints.api.prompts import PromptTooLong
from tokenmill.entrypoints.api.state import ServerState
from tokenmill.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams

# Names a TensorRT-LLM deployment answers to, besides the served model names.
TRTLLM_MODEL_NAMES = ("ensemble", "tensorrt_llm_bls")
INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "stop_words",
          "bad_words", "end_id", "pad_id", "return_log_probs", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "min_length", "min_tokens", "random_seed",
          "seed", "beam_width", "num_return_sequences", "length_penalty",
          "exclude_input_in_output", "return_perf_metrics",
          # structured outputs: TensorRT-LLM's guide (type + text), or a JSON schema
          "guided_decoding_guide_type", "guided_decoding_guide", "guided_json",
          # LoRA: an adapter served by --lora-modules, by id (the model name picks one too)
          "lora_task_id", "lora_weights", "lora_config", "priority",
          # an image-text model's images (TensorRT-LLM's multimodal input): data URLs, one
          # per image token text_input holds
          "image_url_input")
# TensorRT-LLM's guided_decoding_guide_type -> the StructuredOutputsParams field
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex",
               "ebnf_grammar": "grammar"}


class TritonError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def model_known(state: ServerState, model: str) -> bool:
    return model in state.model_names or model in TRTLLM_MODEL_NAMES


def _words(value: Any, name: str) -> list[str]:
    """A string or a list of strings, within the OpenAI routes' caps (entries and length)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TritonError(f"{name} must be a string or a list of strings.")
    problem = CAPS.word_list_problem(value)
    if problem is not None:
        raise TritonError(f"{name} {problem}.")
    return [v for v in value if v]


# Numeric inputs: (kind, lowest, highest) allowed; None = unbounded. Checked whether or not
# the request ends up using them (a greedy request's temperature is still validated).
_NUMBERS = {"max_tokens": (int, 1, None), "temperature": (float, 0.0, None),
            "top_k": (int, 0, None), "top_p": (float, 0.0, 1.0),
            "repetition_penalty": (float, None, None),
            "presence_penalty": (float, -2.0, 2.0), "frequency_penalty": (float, -2.0, 2.0),
            "min_tokens": (int, 0, None), "min_length": (int, 0, None),
            "random_seed": (int, 0, 2**64 - 1), "seed": (int, 0, 2**64 - 1),
            "end_id": (int, 0, None), "pad_id": (int, 0, None),
            "beam_width": (int, 1, CAPS.max_n), "num_return_sequences": (int, 1, CAPS.max_n),
            "length_penalty": (float, -1e3, 1e3), "lora_task_id": (int, 0, 2**64 - 1),
            "priority": (int, -(2**63), 2**63 - 1)}
_DEFAULTS = defaults.TRITON


def _number(fields: dict, name: str, vocab_size: int) -> Any:
    """The value of a numeric input (its default when absent), type- and range-checked."""
    kind, low, high = _NUMBERS[name]
    if name in ("end_id", "pad_id"):
        high = vocab_size - 1
    value = fields.get(name)
    if value is None:
        return _DEFAULTS.get(name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and (kind is float or float(value).is_integer()) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        ok = kind is int and isinstance(value, int)
    if not ok:
        raise TritonError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {json.dumps(value)[:64]}.")
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (f"in [{low}, {high}]" if high is not None else f"at least {low}")
        raise TritonError(f"{name} must be {bounds}, got {value}.")
    return value


def parse(body: Any) -> dict:
    """An HTTP generate body: inputs at the top level or inside `parameters`."""
    if not isinstance(body, dict):
        raise TritonError("The request body must be a JSON object.")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise TritonError("parameters must be a JSON object.")
    return {**{k: v for k, v in body.items() if k != "parameters"}, **params}


def _guide(fields: dict) -> tuple[str | None, StructuredOutputsParams | None]:
    """The structured-output constraint the inputs ask for, and the input that asked."""
    kind, guide = fields.get("guided_decoding_guide_type"), fields.get("guided_decoding_guide")
    schema = fields.get("guided_json")
    if schema is not None and kind is not None:
        raise TritonError("Give guided_json or guided_decoding_guide_type, not both.")
    try:
        if schema is not None:
            if not isinstance(schema, (str, dict)):
                raise TritonError("guided_json must be a JSON schema (an object or its text).")
            return "guided_json", StructuredOutputsParams(json=schema)
        if kind is None:
            if guide is not None:
                raise TritonError("guided_decoding_guide needs guided_decoding_guide_type.")
            return None, None
        if kind not in GUIDE_TYPES:
            raise TritonError(f"guided_decoding_guide_type must be one of "
                              f"{', '.join(GUIDE_TYPES)}, got {str(kind)[:40]!r}.")
        if kind == "json":
            return "guided_decoding_guide_type", StructuredOutputsParams(json_object=True)
        if not isinstance(guide, str) or not guide:
            raise TritonError(f"guided_decoding_guide (a {kind}) is required as a string.")
        return "guided_decoding_guide", StructuredOutputsParams(**{GUIDE_TYPES[kind]: guide})
    except InvalidParameter as exc:
        raise TritonError(str(exc)) from None


def _beams(fields: dict, num: dict, sampling: SamplingParams) -> BeamSearchParams | None:
    """TensorRT-LLM's beam search (`beam_width` > 1; `num_return_sequences` of the beams,
    default all), or None. The inputs that would change which tokens may follow are refused
    with beams (temperature and top_k / top_p do not apply to a search)."""
    width, returned = num["beam_width"], num["num_return_sequences"]
    if width == 1:
        if returned not in (None, 1):
            raise TritonError("num_return_sequences other than 1 needs beam_width > 1 (this "
                              "server samples one sequence per request).")
        if fields.get("length_penalty") is not None:
            raise TritonError("length_penalty applies to beam search only (beam_width > 1).")
        return None
    if returned is not None and returned > width:
        raise TritonError(f"num_return_sequences ({returned}) must be at most beam_width "
                          f"({width}).")
    for name in ("stop_words", "bad_words", "guided_json", "guided_decoding_guide_type",
                 "return_perf_metrics", "min_tokens", "min_length"):
        if fields.get(name) not in (None, False, 0, []):
            raise TritonError(f"{name} is not supported with beam_width > 1.")
    if (sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) != (1.0, 0.0, 0.0):
        raise TritonError("Penalties are not supported with beam_width > 1.")
    return BeamSearchParams(width, sampling.max_tokens, length_penalty=num["length_penalty"],
                            num_return_sequences=returned, eos_token_ids=sampling.stop_token_ids
                            or None)


def beam_fields(beams: list, options: dict) -> dict:
    """A finished search's outputs: one text per beam, best first (and log probs)."""
    out = {"text_output": [options["echo"] + seq.text for seq in beams]}
    if options["log_probs"]:
        out.update(cum_log_probs=[seq.cum_logprob for seq in beams],
                   output_log_probs=[seq.logprobs for seq in beams])
    return out


async def _lora(fields: dict, num: dict, state: ServerState, model: str | None):
    """The adapter the request runs with: its model's name, or `lora_task_id` (with
    `lora_weights` and `lora_config`: registered from them first, api/lora_tensors.py)."""
    by_model = state.lora_for(model)
    task = num["lora_task_id"]
    sent = [fields.get(name) is not None for name in ("lora_weights", "lora_config")]
    if any(sent):
        if not all(sent) or task is None:
            raise TritonError("lora_weights and lora_config are sent together, with the "
                              "lora_task_id they register.")
        if not state.config.engine.enable_lora:
            raise TritonError("LoRA adapters are not enabled: start the server with "
                              "--enable-lora.")
        served = state.lora_of_task(task)
        if served is not None and served.lora_name != task_name(task):
            raise TritonError(f"lora_task_id {task} is the adapter {served.lora_name!r} "
                              "served here; send the id without lora_weights and "
                              "lora_config.")
        try:
            await state.task_adapters.register(state, task, fields["lora_weights"],
                                               fields["lora_config"])
        except ValueError as exc:
            raise TritonError(str(exc)) from None
    if task is None:
        return by_model
    by_task = state.lora_of_task(task)
    if by_task is None:
        raise TritonError(f"LoRA task {task} not found: send its lora_weights and lora_config "
                          f"with it, or name an adapter served here (--lora-modules gives "
                          f"ids 1 to {len(state.adapters)} in order).", 404)
    if by_model is not None and by_model != by_task:
        raise TritonError(f"lora_task_id {task} is adapter {by_task.lora_name!r}, but the "
                          f"model asked for is {model!r}.")
    return by_task


async def parse_fields(fields: dict, state: ServerState, model: str | None = None
                       ) -> tuple[list[int], SamplingParams, dict]:
    """TensorRT-LLM ensemble inputs (HTTP generate or gRPC tensors, as Python values) ->
    prompt ids, sampling params and options (stream, log probs, echo, the LoRA adapter of
    `model` or `lora_task_id`). Every input is checked before the prompt is tokenized (off
    the event loop when long)."""
    unknown = sorted(set(fields) - set(INPUTS))
    if unknown:
        raise TritonError(f"unexpected inference input(s) {unknown[:8]}; accepted: "
                          f"{', '.join(INPUTS)}.")
    text = fields.get("text_input")
    if not isinstance(text, str) or not text:
        raise TritonError("text_input is required and must be a non-empty string.")
    for flag in ("stream", "return_log_probs", "exclude_input_in_output", "return_perf_metrics"):
        if not isinstance(fields.get(flag, False), bool):
            raise TritonError(f"{flag} must be a boolean.")
    vocab = len(state.tokenizer)
    num = {name: _number(fields, name, vocab) for name in _NUMBERS}
    stop = _words(fields.get("stop_words"), "stop_words")
    bad = _words(fields.get("bad_words"), "bad_words")
    lora = await _lora(fields, num, state, model)
    problem = state.priority_problem(num["priority"] or 0)
    if problem is not None:
        raise TritonError(problem)
    urls = fields.get("image_url_input")
    urls = [urls] if isinstance(urls, str) else urls
    if urls is not None and (not isinstance(urls, list) or not all(
            isinstance(u, str) for u in urls)):
        raise TritonError("image_url_input must be a data URL or a list of them.")
    try:
        ids = await state.prompts.encode(text, "text_input")
        images = []
        if urls:
            if state.images is None:
                raise TritonError("This model takes no images.")
            ids, images = await state.images.prepare(ids, urls, "image_url_input")
    except (PromptTooLong, InvalidParameter) as exc:
        raise TritonError(str(exc)) from None
    max_tokens = num["max_tokens"]
    if context_overflow(len(ids), max_tokens, state.max_model_len):
        raise TritonError(f"The prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                          f"exceeds the model's context length ({state.max_model_len}).")
    greedy = num["top_k"] in (0, 1) and num["top_p"] == 0.0  # TensorRT-LLM: greedy then
    seed = num["random_seed"] if num["random_seed"] is not None else num["seed"]
    try:
        sampling = SamplingParams(
            temperature=0.0 if greedy else num["temperature"],
            top_k=num["top_k"], top_p=num["top_p"] or 1.0, max_tokens=max_tokens,
            min_tokens=min(num["min_tokens"] or num["min_length"], max_tokens),
            repetition_penalty=num["repetition_penalty"],
            presence_penalty=num["presence_penalty"],
            frequency_penalty=num["frequency_penalty"], stop=stop, bad_words=bad,
            stop_token_ids=None if num["end_id"] is None else [num["end_id"]], seed=seed,
            logprobs=0 if fields.get("return_log_probs") else None)
    except ValueError as exc:
        raise TritonError(str(exc)) from None
    field, sampling.structured_outputs = _guide(fields)
    try:
        await state.check_structured(sampling.structured_outputs, field)
    except ValueError as exc:
        raise TritonError(str(exc)) from None
    if images and fields.get("beam_width", 1) not in (None, 1):
        raise TritonError("Beam search does not take images.")
    options = {"beams": _beams(fields, num, sampling),
               "stream": fields.get("stream", False),
               "log_probs": fields.get("return_log_probs", False),
               "perf": fields.get("return_perf_metrics", False),
               "echo": "" if fields.get("exclude_input_in_output", False) else text,
               "lora": lora, "priority": num["priority"] or 0, "mm_inputs": images}
    return ids, sampling, options


def logprob_fields(c) -> dict:
    chosen = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs or [])]
    return {"output_log_probs": chosen, "cum_log_probs": c.cumulative_logprob or 0.0}


# TensorRT-LLM's `return_perf_metrics` outputs, integers (times: epoch nanoseconds; 0 for a
# time not reached) and the float acceptance_rate
PERF_INTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
             "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
             "first_token_time_ns", "last_token_time_ns", "total_accepted_draft_tokens",
             "total_draft_tokens")


def perf_fields(out) -> dict:
    """A request's perf metrics from its `RequestOutput.metrics` (the block counts once it
    finished; acceptance_rate 0.0 without drafts)."""
    m = out.metrics
    ns = {f"{name}_ns": int(m.get(name, 0) * 1e9) for name in (
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time")}
    drafts, accepted = int(m.get("num_draft_tokens", 0)), int(m.get("num_accepted_tokens", 0))
    reused, total = int(m.get("kv_cache_reused_blocks", 0)), int(m.get("kv_cache_total_blocks", 0))
    return {"kv_cache_alloc_new_blocks": total - reused, "kv_cache_reused_blocks": reused,
            "kv_cache_alloc_total_blocks": total, **ns,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "total_accepted_draft_tokens": accepted, "total_draft_tokens": drafts}
