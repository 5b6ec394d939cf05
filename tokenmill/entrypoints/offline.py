"""The offline batch API: `LLM(model).generate(prompts, SamplingParams)`, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    step_params,
    top_pairs,
)
from tokenmill.config.engine import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.entrypoints.parsers.tool_request import template_messages
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and data-parallel replicas, if any; also on `del`
        and on leaving a `with LLM(...) as llm:` block."""
        engine = getattr(self, "engine", None)  # absent when __init__ failed
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given none: the model's generation config's
        sampling fields (`generation_config=`, as vLLM reads them), else SamplingParams()."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the
        base model; the engine needs `enable_lora=True`). `priority`: one per prompt (lower
        runs first; the engine needs `scheduling_policy="priority"`)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"Got {len(sampling_params)} sampling params for {len(prompts)} "
                             "prompts; give one, or one per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        elif len(lora_request) != len(prompts):
            raise ValueError(f"Got {len(lora_request)} LoRA requests for {len(prompts)} "
                             "prompts; give one, or one per prompt.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts; give "
                             "one per prompt.")
        return self._run(prompts, list(sampling_params), use_tqdm, list(lora_request),
                         list(priority) if priority is not None else None)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """`tools` (OpenAI's function definitions) are rendered by the chat template; the
        output is text (read it with
        `tokenmill.entrypoints.parsers.tool_calls.get_parser(...).parse`).
        `chat_template`: a Jinja template in place of the tokenizer's (vLLM's argument)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = [self.engine.chat_prompt(template_messages([dict(m) for m in c]),
                                           add_generation_prompt, chat_template, **kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, `num_return_sequences` (default beam_width)
        beams, best first, as transformers' `generate(num_beams=...)` finds them. Each step
        runs every prompt's live beams as one batch (their prefixes from the prefix cache)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.engine
        searches = [BeamSearch(engine.tokenize_prompt(p)[1], params, engine.eos_token_ids)
                    for p in prompts]
        while not all(s.done for s in searches):
            jobs = [(s, tokens) for s in searches for tokens in s.pending()]
            outs = self._run([{"prompt_token_ids": t} for _, t in jobs],
                             [step_params(s) for s, _ in jobs], False)
            for s in searches:
                tops = [top_pairs(out.outputs[0].logprobs[0], s.k)
                        for (owner, _), out in zip(jobs, outs) if owner is s]
                if tops:
                    s.advance(tops)
        decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return [BeamSearchOutput(s.results(decode)) for s in searches]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None,
             priorities: list[int] | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p, lora, priority in zip(prompts, params, loras or [None] * len(prompts),
                                                 priorities or [0] * len(prompts)):
                ids.append(engine.add_request(None, prompt, p, lora, priority))
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step(final_only=True):
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
