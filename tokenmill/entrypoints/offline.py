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
from tokenmill.entrypoints.api import scoring
from tokenmill.entrypoints.api.chat_content import template_content
from tokenmill.entrypoints.api.images import ImageInputs, as_image
from tokenmill.entrypoints.parsers.tool_request import template_messages
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling_params import PoolingParams
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

    # ---- sleep mode and weight updates (engine/control.py), between generate calls ----
    def sleep(self, level: int = 1) -> None:
        """With `enable_sleep_mode=True`: free the KV cache (level 1), and the weights too
        (level 2); generate refuses until `wake_up`."""
        self._control("sleep", level=level)

    def wake_up(self) -> None:
        self._control("wake_up")

    def is_sleeping(self) -> bool:
        return bool(self._core("is_sleeping").sleeping)

    def update_weights_from_disk(self, model_path: str) -> None:
        """Serve the weights of another checkpoint of the same shape (SGLang's name); the
        prefix cache is dropped. On a failure to load them the previous weights serve and
        a ValueError says why."""
        self._control("update_weights", path=model_path)

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  backend: str = "gloo") -> None:
        """Join a trainer's torch.distributed group (SGLang's call; the trainer is rank 0
        and hosts its TCPStore at master_address:master_port) to receive weights."""
        self._control("init_weights_update_group", options={
            "address": master_address, "port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list,
                                        shapes: list) -> None:
        """Receive the named tensors the trainer broadcasts (in this order; dtypes as names
        or torch dtypes) and serve them: the whole checkpoint, as from disk."""
        self._control("update_weights_from_distributed", options={
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes]})

    def destroy_weights_update_group(self) -> None:
        self._control("destroy_weights_update_group")

    def _control(self, action: str, level: int = 0, path: str = "",
                 options: dict | None = None) -> None:
        from tokenmill.engine.control import control

        control(self._core(action), action, level, path, options)

    def _core(self, what: str):
        core = getattr(self.engine, "core", None)
        if core is None:
            raise ValueError(f"LLM.{what} is not built for data-parallel replicas.")
        return core

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
        sampling_params = _per_prompt(sampling_params, SamplingParams, len(prompts),
                                      "sampling params")
        lora_request = _per_prompt(lora_request, LoRARequest, len(prompts), "LoRA requests")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts; give "
                             "one per prompt.")
        return self._run(prompts, sampling_params, use_tqdm, lora_request,
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
        `tokenmill.entrypoints.parsers.tool_registry.get_parser(...).parse`).
        `chat_template`: a Jinja template in place of the tokenizer's (vLLM's argument).
        An image-text model takes `image_url` content parts (data URLs)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = []
        for conversation in conversations:
            urls = [] if self.engine.multimodal is not None else None
            turns = [{**m, "content": template_content(m["content"], urls)}
                     if isinstance(m.get("content"), list) else dict(m) for m in conversation]
            prompt = self.engine.chat_prompt(template_messages(turns), add_generation_prompt,
                                             chat_template, **kwargs)
            prompts.append({**prompt, "multi_modal_data": {"image": urls}} if urls else prompt)
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

    # ---- pooling models (--runner pooling): vectors and scores, no text ---------------
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[RequestOutput]:
        """Each prompt's pooled vector (`RequestOutput.pooled`), as `pooling_params` asks
        (default: the model's own task)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        pooler = self.engine.pooler
        if pooling_params is None:
            pooling_params = PoolingParams(task=pooler.task if pooler else "embed")
        pooling_params = _per_prompt(pooling_params, PoolingParams, len(prompts),
                                     "pooling params")
        lora_request = _per_prompt(lora_request, LoRARequest, len(prompts), "LoRA requests")
        return self._run(prompts, [SamplingParams(max_tokens=1)] * len(prompts), use_tqdm,
                         lora_request, pooling=pooling_params)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding (`.outputs.embedding`)."""
        results = self.encode(prompts, pooling_params or PoolingParams(task="embed"),
                              use_tqdm, lora_request)
        return [EmbeddingRequestOutput(r.request_id, EmbeddingOutput(r.pooled),
                                       r.prompt_token_ids) for r in results]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 lora_request: LoRARequest | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify: each prompt's class probabilities (`.outputs.probs`)."""
        results = self.encode(prompts, PoolingParams(task="classify"), use_tqdm, lora_request)
        return [ClassificationRequestOutput(r.request_id, ClassificationOutput(r.pooled),
                                            r.prompt_token_ids) for r in results]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True, lora_request: LoRARequest | None = None
              ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: `data_1` against each of `data_2` (one to many, or pairwise):
        a cross-encoder's relevance, or an embedding model's cosine similarity."""
        pooler = self.engine.pooler
        scoring.check_scorer(pooler)
        texts = scoring.pairs(data_1 if isinstance(data_1, str) else list(data_1),
                              data_2 if isinstance(data_2, str) else list(data_2))
        if scoring.is_cross_encoder(pooler):
            tokenizer = self.get_tokenizer()
            prompts = [{"prompt_token_ids": scoring.pair_token_ids(tokenizer, a, b)}
                       for a, b in texts]
            results = self.encode(prompts, PoolingParams(task="classify"), use_tqdm,
                                  lora_request)
            return [ScoringRequestOutput(r.request_id, ScoringOutput(r.pooled[0]),
                                         r.prompt_token_ids) for r in results]
        firsts = sorted({a for a, _ in texts})
        seconds = sorted({b for _, b in texts})
        vectors = self.encode(firsts + seconds, PoolingParams(task="embed"), use_tqdm,
                              lora_request)
        of_first = dict(zip(firsts, vectors[:len(firsts)]))
        of_second = dict(zip(seconds, vectors[len(firsts):]))
        return [ScoringRequestOutput(
            f"score-{i}", ScoringOutput(scoring.cosine(of_first[a].pooled, of_second[b].pooled)),
            of_first[a].prompt_token_ids + of_second[b].prompt_token_ids)
            for i, (a, b) in enumerate(texts)]

    def _images(self, prompt: PromptType) -> tuple[PromptType, list]:
        """vLLM's `{"prompt": ..., "multi_modal_data": {"image": PIL image(s)}}`: the prompt
        with its image tokens grown to the images' placeholders, and the images."""
        if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
            return prompt, []
        data = prompt["multi_modal_data"]
        if set(data) - {"image"}:
            raise ValueError("multi_modal_data takes images ({\"image\": ...}) only.")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        text, ids = self.engine.tokenize_prompt({k: v for k, v in prompt.items()
                                                 if k != "multi_modal_data"})
        ids, inputs = self._image_inputs().place(ids, [as_image(i) for i in images], "prompt")
        return {"prompt_token_ids": ids, "prompt": text}, inputs

    def _image_inputs(self) -> ImageInputs:
        config = self.engine.multimodal
        if config is None:
            raise ValueError("This model takes no images.")
        if getattr(self, "_processor", None) is None:
            self._processor = ImageInputs(self.engine.model_path, config,
                                          tokenizer=self.get_tokenizer())
        return self._processor

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None,
             priorities: list[int] | None = None,
             pooling: list[PoolingParams] | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        n = len(prompts)
        try:
            for prompt, p, lora, priority, pool in zip(prompts, params, loras or [None] * n,
                                                       priorities or [0] * n,
                                                       pooling or [None] * n):
                prompt, images = self._images(prompt)
                ids.append(engine.add_request(None, prompt, p, lora, priority, pool, images))
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step(final_only=True):
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except Exception:  # (one request failed: the others of this call stop too)
                engine.abort_request([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]


def _per_prompt(value: Any, kind: type, n: int, what: str) -> list:
    """One `kind` (or None) for every prompt, or a list of one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"Got {len(value)} {what} for {n} prompts; give one, or one per "
                         "prompt.")
    return list(value)
