"""Turns a scheduler step into tensors, runs the model once over all its tokens, and samples."""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any

import numpy as np
import torch

from tokenmill.config import kernels as kernel_switches
from tokenmill.config.engine import EngineConfig
from tokenmill.config.model import ModelConfig
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.distributed.parallel_state import get_tp_group, get_world
from tokenmill.distributed.pipeline import PendingLogits
from tokenmill.loading.checkpoint import load_model
from tokenmill.platforms import get_platform, resolve_device
from tokenmill.sample.request_sampling import RequestSampling
from tokenmill.worker import graph_capture, kv_cache, mm_encoder, state_cache, step_paths
from tokenmill.worker.cpu_decode_step import CpuDecodeStep
from tokenmill.worker.stage_io import StageIO
from tokenmill.worker.step_inputs import StepInputs
from tokenmill.worker.step_paths import EagerPath, StepTensors
from tokenmill.worker.step_results import Launched, RunnerOutput, sample_step, score_prompt

logger = logging.getLogger(__name__)

def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    return get_platform(device).default_dtype(hf_config)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: ModelConfig) -> None:
        self.config = config
        with kernel_switches.using(config.kernels):  # (what the loaders and kernels read)
            self._start(config, model)

    def _start(self, config: EngineConfig, model: ModelConfig) -> None:
        """Device, model, KV cache, draft heads and step paths, in that order."""
        model_path, hf_config, max_model_len = model.path, model.hf_config, model.max_model_len
        # joined before the model is built (executor/multiproc.py)
        self.tp, self.world = get_tp_group(), get_world()
        self.in_flight = 0  # steps launched and not completed
        # asynchronous scheduling: steps sampled as they launch; the latest one's tokens on
        # the device and each request's row there (the next step's inputs read them)
        self.async_scheduling = config.async_scheduling
        self.previous: tuple[torch.Tensor, dict[str, int]] | None = None
        self.device = resolve_device(config.device, self.world.rank, config.ranks_per_node)
        self.platform = get_platform(self.device)
        self.io = StageIO(self.world, self.tp, self.device)  # (step messages, hand-offs)
        self.platform.setup_process()
        asked = resolve_dtype(config.dtype, hf_config, self.device)
        self.dtype, bf16_weights = self.platform.model_dtypes(asked)
        self.block_size = config.block_size
        self.vocab_size, self.hidden_size = hf_config.vocab_size, hf_config.hidden_size
        # The seed's 3.0 checkpoints mark an int8 KV cache in config.json; it wins over "auto".
        kv_int8 = config.kv_cache_dtype == "int8" or hasattr(hf_config,
                                                             "infer_model_cachekv_int8_type")
        # "auto": the model's dtype as asked (under bf16 weights a CPU computes in float32
        # and keeps bf16 K/V rows, read as its weights are)
        floats = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        kv_float = floats.get(config.kv_cache_dtype,
                              torch.bfloat16 if bf16_weights else self.dtype)
        if (config.kv_cache_dtype in floats and self.device.type != "cpu"
                and kv_float != self.dtype):
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} on a GPU keeps K/V in "
                             f"the model's own dtype ({str(self.dtype).removeprefix('torch.')}"
                             "): drop the flag, or pick that --dtype.")
        self.kv_dtype = (torch.int8 if kv_int8 else torch.float8_e4m3fn
                         if config.kv_cache_dtype == "fp8" else kv_float)
        self.backend = self.platform.attention_backend(config.attention_backend)
        self.platform.check_kv_cache(self.kv_dtype, self.backend)  # (before the weights load)
        spec = config.speculative_config
        method = getattr(spec, "method", None)  # (draft heads reading the target's LM head)
        self.model = load_model(model_path, hf_config, self.dtype, self.device, max_model_len,
                                config.quantization, mtp=method == "mtp",
                                head_on_first_stage=method in ("mtp", "eagle"),
                                bf16_weights=bf16_weights, pooling=model.pooler is not None)
        self.pooler = self.images = None  # a pooling model's (vectors, not tokens); an
        if model.pooler is not None:  # image-text model's image side (mm_encoder.py)
            from tokenmill.worker.pooler import Pooler
            self.pooler = Pooler(model.pooler, model_path, self.device)
        if model.multimodal is not None and self.world.rank == 0:
            from tokenmill.worker.mm_encoder import ImageEncoder
            self.images = ImageEncoder(model_path, model.multimodal, self.device, self.dtype)
        self.bidirectional_images = model.multimodal is not None and model.multimodal.bidirectional
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.sampling = RequestSampling(self.vocab_size, self.device)
        layers = self.model.attention_layers()
        heads = None
        self.target_states = None  # what draft heads read of a step (every rank: stages carry it)
        if spec is not None and spec.method in ("mtp", "eagle", "eagle3"):
            from tokenmill.worker.draft_heads import TargetHiddenStates, draft_heads

            self.target_states = TargetHiddenStates.of(spec, self.model)
            if self.world.is_first_stage:  # (the heads run beside the sampler)
                heads = draft_heads(spec, self.model, model_path, self.dtype, self.device)
                layers = layers + [head.block.self_attn for head in heads]  # caches too
        self.num_layers = len(layers)
        values = not layers or layers[0].stores_values  # (MLA: one latent row, no V)
        if not values and self.kv_dtype == torch.int8:
            raise ValueError("An int8 KV cache is not built for DeepSeek's latent attention: "
                             "drop --kv-cache-dtype int8.")
        self.block_bytes = kv_cache.bytes_per_block(
            self.num_layers, self.block_size, layers[0].num_kv_heads, layers[0].head_dim,
            self.kv_dtype, values) if layers else 0  # (Mamba-2: blocks only count tokens)
        # state layers (Mamba-2, gated DeltaNet): a state slot per running request
        self.num_state_slots = state_cache.build(
            self.model, config, self.dtype, self.device, self.world,
            lambda: self.platform.kv_budget_bytes(
                config.kv_cache_memory_gib, config.gpu_memory_utilization,
                ranks_here=config.ranks_on_machine) // (2 if layers else 1))
        self.state_bytes = sum(t.nbytes for m in state_cache.state_layers(self.model)
                               for t in (m.conv_state, m.ssm_state))
        self.heads = self.decode_step = self.graphs = self.pieces = None  # (set below)
        self.lora = None
        if config.enable_lora:
            from tokenmill.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.dtype,
                                    self.device)
        self.paths = step_paths.ordered(None, None, self._eager())  # (profiling: eager)
        self._layers, self._values = layers, values
        # Every rank the same block count: the scheduler's block ids index each rank's cache.
        self.num_blocks = self.world.all_reduce_min(self._decide_num_blocks(max_model_len))
        self._bind_cache(self.num_blocks)
        if heads is not None:
            from tokenmill.worker.draft_heads import HeadDrafter, TargetView

            self.heads = HeadDrafter(TargetView.of(self), spec, heads)
        self.build_step_paths(max_model_len)
        kv_cache.log_size(self.num_blocks, self.block_size, self.block_bytes, self.kv_dtype,
                          config.ranks_on_machine, max_model_len)

    def _eager(self) -> EagerPath:
        return EagerPath(self.model, self.backend, logits_rows_only=self.target_states is None)

    def build_step_paths(self, max_model_len: int) -> None:
        """The compiled decode step and the graphs over the bound caches (again after sleep
        mode rebinds them: worker/sleep_mode.py), and the step paths in order."""
        # All-decode steps of a few sequences on the CPU: every layer in one compiled call.
        self.decode_step = CpuDecodeStep.build(self.model, self.backend)
        if self.target_states is not None and self.target_states.aux:  # (hooks C would skip)
            self.decode_step = None
        # Tensor-parallel ranks must take the same path every step (their collectives pair up).
        rows = self.tp.all_reduce_min(self.decode_step.max_rows if self.decode_step else 0)
        if rows == 0:
            self.decode_step = None
        else:
            self.decode_step.max_rows = rows
            self.decode_step.lora = self.lora  # (its steps add the adapters' products too)
        reserved = self.platform.reserved_bytes()
        self.graphs, self.pieces = graph_capture.build(self, max_model_len)
        self.paths = step_paths.ordered(self.pieces, self.decode_step, self._eager())
        if self.graphs is not None and self.heads is not None:
            self.heads.capture(self.graphs, self.graphs.pool is not None)
        self.graph_bytes = self.platform.reserved_bytes() - reserved  # (beside the budget)
        if self.graph_bytes:
            logger.info("CUDA graphs hold %.2f GiB beside the KV cache", self.graph_bytes / 2**30)

    def _bind_cache(self, num_blocks: int) -> None:
        """A KV cache of `num_blocks` blocks for every attention layer."""
        if not self._layers:
            return
        attn = self._layers[0]
        caches = kv_cache.allocate_kv_cache(self.num_layers, num_blocks, self.block_size,
                                            attn.num_kv_heads, attn.head_dim, self.kv_dtype,
                                            self.device, self._values)
        for layer, (k, v) in zip(self._layers, caches, strict=True):
            layer.k_cache, layer.v_cache, layer.backend = k, v, self.backend

    def profile_step(self, max_model_len: int) -> None:
        """The largest step the scheduler sends (its token budget as one prompt) over a
        throwaway cache of its size: the activations the KV budget must leave room for."""
        n = min(self.config.token_budget(max_model_len), max_model_len)
        blocks = -(-n // self.block_size)
        bound = [(layer.k_cache, layer.v_cache, layer.backend) for layer in self._layers]
        self._bind_cache(blocks)
        inputs = (StepInputs([0] * n, [0], [n], [list(range(blocks))], [], [], [], [],
                             pool_seqs=[0]) if self.pooler is not None else
                  StepInputs([0] * n, [0], [n], [list(range(blocks))], [0], [], [], [1]))
        with torch.inference_mode():
            self.run(inputs, b"")
        for layer, (k, v, backend) in zip(self._layers, bound):  # (none yet at start-up)
            layer.k_cache, layer.v_cache, layer.backend = k, v, backend

    def _decide_num_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if not self.block_bytes:  # (no attention layer: every running request's context)
            return self.config.max_num_seqs * -(-max_model_len // self.block_size)
        profile = None
        if self.world.size == 1:  # (ranks would have to profile in step: not yet)
            profile = functools.partial(self.profile_step, max_model_len)
        full_contexts = self.config.max_num_seqs * -(-max_model_len // self.block_size)
        budget = self.platform.kv_budget_bytes(
            self.config.kv_cache_memory_gib, self.config.gpu_memory_utilization, profile,
            ranks_here=self.config.ranks_on_machine, wanted=full_contexts * self.block_bytes)
        if self.config.kv_cache_memory_gib is not None or self.device.type == "cpu":
            budget -= self.state_bytes  # (a measured budget has them counted already)
        num_blocks = kv_cache.num_blocks_for_budget(budget, self.block_bytes)
        if num_blocks < 1:
            raise ValueError("The KV cache budget holds no block: raise kv_cache_memory_gib / "
                             "gpu_memory_utilization.")
        return num_blocks

    # ---- one step ---------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """A step is in flight, or was cut short (e.g. Ctrl-C): the other ranks may be inside
        a collective, so a stop message would pair with the wrong one."""
        return self.in_flight > 0

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        launched = self.launch(step)
        return RunnerOutput() if launched is None else self.complete(launched)

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> Launched | None:
        """Rank 0 (the engine core's runner): the step's inputs to every rank, and its forward
        started; under pipeline parallel this returns once stage 0's part is done, the logits
        still to come (`complete` waits for them). None: nothing to run."""
        self.sampling.drop(step.finished_ids)
        for held in (self.pooler, self.images):  # (what each request kept)
            if held is not None:
                held.drop(step.finished_ids)
        if step.empty:
            self.io.release(step.finished_ids)
            return None
        # Decodes first: the backend attends over them in one batched gather; then by LoRA
        # adapter, so that each adapter's rows are one run (lora/layers.py: a view, no gather).
        scheduled = sorted(step.scheduled, key=lambda s: (s.num_new_tokens != 1,
                                                          s.request.lora_id))
        announced = self.lora.take_announced() if self.lora is not None else None
        inputs = StepInputs.of(scheduled, announced if self.world.size > 1 else None,
                               self.bidirectional_images)
        data = self.io.send(inputs, scheduled, step.finished_ids)
        self.in_flight += 1  # (taken back only when every rank's part of the step is done)
        images = self.images.step_rows(scheduled) if self.images is not None else None
        fill = (step_paths.pending_fill(scheduled, self.previous, self.device)
                if self.async_scheduling else None)
        result = self.run(inputs, data, fill, images)
        if isinstance(result, PendingLogits):
            return Launched(scheduled, inputs, pending=result)
        logits, prompt_logits, hidden_states, pooled = result
        launched = Launched(scheduled, inputs, logits, prompt_logits,
                            hidden=hidden_states if self.heads is not None else None,
                            pooled=pooled)
        if self.async_scheduling:  # sampled now, so the next step can launch before this one lands
            self._sample(launched)
        return launched

    @torch.inference_mode()
    def complete(self, launched: Launched) -> RunnerOutput:
        """Sample a launched step, unless it was at launch (its logits awaited first under
        pipeline parallel), and wait for its tokens."""
        inputs, scheduled = launched.inputs, launched.scheduled
        if launched.pending is not None:
            got = launched.pending.wait()
            if self.heads is not None:
                got, launched.hidden = self.target_states.split(got)
            launched.logits, launched.prompt_logits = ((got[0], got[1:]) if inputs.sample_seqs
                                                       else (None, got))
        self.in_flight -= 1
        if launched.output is None:
            self._sample(launched)
        out = launched.results()
        for i, scored in zip(inputs.prompt_seqs, launched.prompt_logits):
            score_prompt(scheduled[i], scored, out)
        if launched.pooled:  # (requests pooled: they end sampling nothing)
            out.pooled = self.pooler.finish(scheduled, inputs.pool_seqs, launched.pooled)
            out.sampled.update((rid, []) for rid in out.pooled)
        if launched.hidden is not None:
            out.drafts = self.heads.after_step(scheduled, inputs, launched.hidden, out.sampled)
        return out

    def _sample(self, launched: Launched) -> None:
        token_ids = sample_step(launched, self.sampling, self.generator, self.previous)
        if self.async_scheduling and token_ids is not None:  # (the next step's inputs read them)
            self.previous = token_ids, {rid: i for i, rid in enumerate(launched.tokens[1])}

    def run(self, inputs: StepInputs, data: bytes, fill=None, images=None
            ) -> tuple[torch.Tensor | None, list, Any] | PendingLogits | None:
        """The forward every rank runs (`data`: the inputs' bytes, handed on to the next
        pipeline stage; `fill`: what `step_paths.pending_fill` returns; `images`: the
        step's image rows, mm_encoder.py): on rank 0 the logits of the sampled rows and of
        each prompt-logprob range (and what draft heads read:
        `TargetHiddenStates.taken`), or under pipeline parallel their pending receive from
        the last stage (stage 0's other ranks with draft heads: that of their hidden states),
        and each pooled sequence's partial state (`Pooler.reduce`); None (or Nones) on the
        other ranks."""
        if self.async_scheduling:
            fill = self.io.shared_fill(fill)
        if self.lora is not None and inputs.lora_prefetch and self.world.rank != 0:
            self.lora.prefetch(inputs.lora_prefetch)
        if self.lora is not None:  # (each row's adapter slot, for the layers that add theirs)
            self.lora.prepare(inputs.lora_ids, inputs.lora_requests,
                              [end - start for start, end in zip(inputs.starts, inputs.ends)])
        # (graphs hold the base model's forward: a step with LoRA adapters runs eagerly)
        if self.graphs is not None and not inputs.lora_ids and self.graphs.bucket_rows(inputs):
            logits, hidden_states = self.graphs.run(inputs, fill)
            states = self.target_states
            return logits, [], states.taken(hidden_states) if states else None, []
        input_ids, positions, meta = self.prepare_inputs(inputs)
        if fill is not None:
            fill(input_ids)
        sample_rows = inputs.sample_seqs
        drafted = inputs.num_sampled_rows > len(sample_rows)  # rows of draft tokens scored
        world, link = self.world, self.io.link
        tag = link.next_tag() if link is not None else 0
        intermediate, before = None, []  # (before: EAGLE-3's states from earlier stages)
        if not world.is_first_stage:
            extra = self.target_states.carried_in() if self.target_states else 0
            *intermediate, before = link.intermediate_from_prev(len(input_ids), self.hidden_size,
                                                                self.dtype, extra)
        embeds = (mm_encoder.inputs_embeds(self.model, self.tp, input_ids, inputs.image_rows,
                                           images)
                  if inputs.image_rows and world.is_first_stage else None)
        hidden, logits_rows = step_paths.run_first(self.paths, StepTensors(
            input_ids, positions, meta, inputs, intermediate, drafted, embeds))
        if not world.is_last_stage:
            pending = None
            # (posted before the step goes on: the last stage never waits for it)
            if world.rank == 0 or self.heads is not None:
                shapes = []
                if world.rank == 0:
                    shapes = [(inputs.num_sampled_rows, self.vocab_size)] if sample_rows else []
                    shapes += [(n, self.vocab_size) for _, n in inputs.prompt_rows]
                if self.heads is not None:
                    shapes += [(len(input_ids), self.hidden_size)] * self.target_states.count
                pending = link.expect(shapes, self.dtype, tag)
            link.to_next(data, *hidden,
                         extra=self.target_states.carry(before) if self.target_states else [])
            return pending
        logits = None
        if sample_rows:
            # with `logits_rows`, hidden holds exactly the sampled rows (their last tokens), in
            # order; so does a step whose every row is sampled (decodes)
            every = logits_rows is not None or inputs.num_sampled_rows == len(hidden)
            index = None if every else [meta.query_start_loc[i + 1] - n + r
                                        for i, n in zip(sample_rows, inputs.sample_counts)
                                        for r in range(n)]
            logits = self._logits(hidden if every else hidden[index],
                                  np.arange(len(hidden)) if every else np.array(index))
        prompt_logits = [self._logits(hidden[first:first + n], np.arange(first, first + n))
                         for first, n in inputs.prompt_rows]
        hidden_states = self.target_states.of_step(before, hidden) if self.target_states else []
        if link is not None:  # the last stage's logits (and hidden_states) to stage 0
            link.to_first(([logits] if logits is not None else []) + prompt_logits, hidden_states,
                          tag)
            return None
        taken = self.target_states.taken(hidden_states) if hidden_states else None
        pooled = (self.pooler.reduce(hidden, meta.query_start_loc, inputs.pool_seqs)
                  if inputs.pool_seqs and self.world.rank == 0 else [])
        return logits, prompt_logits, taken, pooled

    def _logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor | None:
        """compute_logits of `hidden`, the step's token `rows` (an LM head's adapters)."""
        if self.lora is None:
            return self.model.compute_logits(hidden)
        self.lora.logits_rows(rows)
        try:
            return self.model.compute_logits(hidden)
        finally:
            self.lora.logits_rows(None)

    def serve_steps(self) -> None:
        """Ranks other than 0: run each step rank 0 sends, until it sends the stop."""
        waiting = collections.deque()  # stage 0 under pipeline parallel with draft heads
        with torch.inference_mode():
            while True:
                data = self.io.receive()
                if not data:
                    return
                heads = self.heads
                if heads is not None and heads.ends_step(data):  # (pipeline parallel)
                    inputs, pending = waiting.popleft()
                    heads.follow(self.target_states.split(pending.wait())[1], inputs, data)
                    continue
                inputs = self.io.decode(data)
                result = self.run(inputs, data)
                if heads is not None and isinstance(result, PendingLogits):
                    waiting.append((inputs, result))  # (drafted for when rank 0 completes it)
                elif heads is not None and result is not None:
                    heads.follow(result[2], inputs)

    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks' `serve_steps` to return."""
        self.io.stop()

    def prepare_inputs(self, inputs: StepInputs):
        """The step's (input ids, positions, attention metadata) on the device."""
        return step_paths.device_inputs(inputs, self.block_size, self.device, self.backend,
                                        state_cache.rows_per_slot(self.config))
