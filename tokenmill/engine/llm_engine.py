"""Synchronous engine front: tokenize, add requests, step the core, return user results."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from tokenmill import heap
from tokenmill.config.engine import EngineConfig
from tokenmill.config.generation import log_defaults, sampling_defaults
from tokenmill.engine.core_client import InprocClient
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.errors import request_error
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.protocol import EngineCoreRequest
from tokenmill.loading.checkpoint import load_tokenizer, resolve_model_path
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import apply_chat_template, bad_words_token_ids, eos_token_ids

logger = logging.getLogger(__name__)

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt" text beside it).
PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model, revision=config.revision,
                                             cache_dir=config.download_dir)
        logger.info("loading %s", self.model_path)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        logger.info("tokenizer ready (%d tokens)", len(self.tokenizer))
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_path)
        # (read before the engine loads: a bad file fails first)
        self.sampling_defaults = sampling_defaults(self.model_path, config.generation_config,
                                                   config.override_generation_config)
        log_defaults(self.sampling_defaults)
        if config.data_parallel_size > 1:  # engine cores in processes of their own
            from tokenmill.engine.dp_offline import ReplicaClient
            self.core = None
            self.client = ReplicaClient(config, self.model_path)
        else:
            self.core = EngineCore(config, self.model_path)
            self.client = InprocClient(self.core)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        heap.trim()  # (what building the tokenizer and loading freed)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len if self.core is not None else self.client.max_model_len

    @property
    def multimodal(self):
        """An image-text model's MultiModalConfig (config/multimodal.py); None: text only."""
        return (self.core.model_config.multimodal if self.core is not None
                else self.client.info.multimodal)

    @property
    def pooler(self):
        """A pooling model's PoolerConfig (config/pooling.py); None: it generates."""
        return (self.core.model_config.pooler if self.core is not None
                else self.client.info.pooler)

    def shutdown(self) -> None:
        """Stop what runs beside this process: tensor-parallel workers, replicas."""
        if self.core is not None:
            self.core.shutdown()
        else:
            self.client.close()

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            # (`set(map(type, ...))` runs in C: the generator alone took 0.1 ms for 2k ids)
            if not isinstance(ids, list) or (set(map(type, ids)) - {int} and not all(
                    isinstance(t, int) for t in ids)):
                raise ValueError("prompt_token_ids must be a list of integers.")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize_prompt(prompt["prompt"])
        raise ValueError("A prompt must be a string or a dict with 'prompt_token_ids'.")

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs: Any) -> dict[str, Any]:
        """`chat_template`: in place of the tokenizer's (None: the tokenizer's)."""
        ids = apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                  chat_template, **template_kwargs)
        return {"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids)}

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams, lora_request: LoRARequest | None = None,
                    priority: int = 0, pooling_params: PoolingParams | None = None,
                    mm_inputs: list | None = None) -> str:
        request_id = str(next(self._counter)) if request_id is None else request_id
        if self.output_processor.has_request(request_id):
            raise ValueError(f"Request id {request_id!r} is already in the engine.")
        if params.kv_transfer_params and self.config.kv_transfer_config is None:
            raise ValueError("kv_transfer_params need an engine with kv_transfer_config.")
        text, prompt_ids = self.tokenize_prompt(prompt)
        if params.structured_outputs is not None:  # a bad schema / regex / grammar: raised here
            self._grammars().compile(params.structured_outputs)
        bad_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        params = params.clone(eos_token_ids=list(self.eos_token_ids),
                              bad_words_token_ids=bad_ids)
        child_ids = self.output_processor.add_request(request_id, text, prompt_ids, params)
        added: list[str] = []
        try:
            for i, child_id in enumerate(child_ids):
                child_params = params.for_child(i)
                self.client.add_request(EngineCoreRequest(child_id, prompt_ids, child_params,
                                                          time.monotonic(), lora_request,
                                                          priority, pooling_params,
                                                          mm_inputs or []))
                added.append(child_id)
        except Exception:
            self.client.abort_requests(added)
            self.output_processor.abort_request(request_id)
            raise
        return request_id

    def _grammars(self):
        """The structured-output compiler: the in-process engine core's (its cache then
        serves the core's own compile), else one of this process."""
        if self.core is not None:
            return self.core.structured.grammars(self.eos_token_ids, self.tokenizer)
        if getattr(self, "_compiler", None) is None:
            from tokenmill.loading.checkpoint import load_hf_config
            from tokenmill.structured_output.backend import Grammars

            self._compiler = Grammars(self.tokenizer, load_hf_config(self.model_path).vocab_size,
                                      list(self.eos_token_ids))
        return self._compiler

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            self.client.abort_requests(children)
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step: the results of the requests it advanced (`final_only`: of those
        it finished; the offline `LLM` builds no result a request has not finished)."""
        outputs = self.client.get_output()
        for out in outputs:  # (a request the core refused: its error raised)
            if out.error is not None and not out.new_token_ids and (
                    parent := self.output_processor.parent_of(out.request_id)):
                self.abort_request([parent])
                raise request_error(out.error, out.retry_after, out.status)
        results, stopped = self.output_processor.process_outputs(outputs, final_only)
        self.client.finish_requests(stopped)
        return results
