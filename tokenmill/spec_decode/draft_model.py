"""A draft model proposes: any model the engine serves that shares the target's tokenizer
(a small sibling, or the target itself loaded quantized: `"quantization": "int4"` with no
`"model"`), run by its own `ModelRunner` over its own paged KV cache.

After each target step a speculating request feeds the draft the tokens its cache lacks (the
whole prompt the first time; afterwards the target's new token, and the last accepted draft
when all were accepted), then k - 1 one-token steps: draft token j + 1 from the draft's scores
after draft token j, greedy for greedy requests, else drawn from the draft's distribution
under the request's own settings (kept for the rejection sampler). The draft cache keeps the
KV of the drafts it computed; the next step keeps the part the target accepted."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.config.model import ModelConfig
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.core.block_pool import Block, BlockPool
from tokenmill.core.request import Request
from tokenmill.loading.checkpoint import load_hf_config, load_tokenizer, resolve_model_path
from tokenmill.sample.request_sampling import RequestSampling
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

_SEED_OFFSET = 0x5DEECE66D


@dataclass
class _Cached:
    """What the draft cache holds for one request: its first `computed` tokens, then the
    KV of the drafts `written` after them."""

    blocks: list[Block] = field(default_factory=list)
    computed: int = 0
    written: list[int] = field(default_factory=list)

    def valid(self, tokens: list[int]) -> int:
        """Positions whose KV matches `tokens` (at most all but the last token, which the
        draft feeds to score the next position)."""
        n = self.computed
        for token in self.written:
            if n >= len(tokens) or tokens[n] != token:
                break
            n += 1
        return min(n, len(tokens) - 1)


def check_vocabulary(draft_path: str, target_path: str, draft_vocab: int,
                     target_vocab: int) -> None:
    """The draft must spell tokens as the target does: the same tokenizer vocabulary (the
    embedding tables may differ in padding rows)."""
    if draft_path == target_path:
        return
    ours, theirs = load_tokenizer(draft_path).get_vocab(), load_tokenizer(target_path).get_vocab()
    if ours != theirs:
        raise ValueError(f"The draft model's tokenizer ({len(ours)} tokens, vocab_size "
                         f"{draft_vocab}) differs from the target's ({len(theirs)} tokens, "
                         f"vocab_size {target_vocab}): speculative decoding needs a draft "
                         "that shares the target's vocabulary.")


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, engine_config, target: ModelConfig,
                 num_blocks: int, make_runner: Callable[..., Any]) -> None:
        """`make_runner`: the engine's model runner class, which runs the draft model."""
        from tokenmill.distributed.parallel_state import single_rank
        from tokenmill.models.info import derive_max_model_len, has_state_layers

        target_path, target_hf = target.path, target.hf_config
        path = resolve_model_path(config.model) if config.model else target_path
        hf = load_hf_config(path)
        check_vocabulary(path, target_path, hf.vocab_size, target_hf.vocab_size)
        if has_state_layers(hf):  # (its state would follow every draft it proposed)
            raise ValueError("A draft model with state layers (Mamba-2, Qwen3-Next's linear "
                             "attention) is not built: use n-gram or MTP speculation, or a "
                             "draft model without them.")
        # (one rank: under tensor parallel the draft runs whole, on rank 0 alone)
        draft_config = dataclasses.replace(
            engine_config, model=path, quantization=config.quantization,
            speculative_config=None, num_kv_blocks=num_blocks, kv_cache_dtype="auto",
            max_model_len=None, tensor_parallel_size=1, pipeline_parallel_size=1, nnodes=1,
            node_rank=0, enable_expert_parallel=False, enable_lora=False)  # (no adapters)
        super().__init__(config, min(target.max_model_len,
                                     derive_max_model_len(draft_config, hf)))
        with single_rank():
            self.runner = make_runner(draft_config, ModelConfig(path, hf, self.max_model_len))
        # Draws independent of the target's (the same stream would correlate each draft with
        # the uniform that tests it, and bias the output).
        self.runner.generator.manual_seed(engine_config.seed + _SEED_OFFSET)
        self.vocab = min(hf.vocab_size, target_hf.vocab_size)  # drafts are target tokens
        self.runner.sampling = RequestSampling(self.vocab, self.runner.device, _SEED_OFFSET)
        self.block_size = self.runner.block_size
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=False)
        self.cached: dict[str, _Cached] = {}
        self.target_vocab = target_hf.vocab_size
        logger.info("Draft model %s%s: %d KV blocks", path,
                    f" ({config.quantization})" if config.quantization else "",
                    self.runner.num_blocks)

    def release(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self._free(request_ids)
        self.runner.sampling.drop(request_ids)

    def _free(self, request_ids: Iterable[str]) -> None:
        """Give the requests' draft-cache blocks back (their KV is recomputed if needed)."""
        for rid in list(request_ids):
            cached = self.cached.pop(rid, None)
            if cached is not None:
                self.pool.free_blocks(reversed(cached.blocks))

    def _room(self, request: Request, cached: _Cached, positions: int,
              keep: set[str]) -> bool:
        """Blocks for the first `positions` positions of the request, taking them back from
        requests not drafting now when the pool is short (False: none to spare)."""
        need = -(-positions // self.block_size) - len(cached.blocks)
        if need > self.pool.num_free_blocks:
            self._free([rid for rid in self.cached if rid not in keep])
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            cached.blocks += self.pool.get_new_blocks(need)
        return True

    @torch.inference_mode()
    def draft(self, chosen: list[tuple[Request, int]]) -> None:
        keep = {r.request_id for r, _ in chosen}
        seqs = []  # (request, k, its draft cache)
        for request, k in chosen:
            cached = self.cached.setdefault(request.request_id, _Cached())
            if self._room(request, cached, request.num_tokens + k - 1, keep):
                seqs.append((request, k, cached))
        if not seqs:
            return
        # step 1: the tokens each cache lacks, scoring the position after the last one
        feeds = []
        for request, _, cached in seqs:
            tokens = request.prompt_token_ids + request.output_token_ids
            start = cached.valid(tokens)
            feeds.append((cached, tokens[start:], start))
            cached.computed, cached.written = len(tokens), []
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j in range(max(k for _, k, _ in seqs)):
            if j > 0:  # step j + 1: draft j's KV, scoring the position after it
                active = [i for i in active if seqs[i][1] > j]
                feeds = [(seqs[i][2], [drafts[i][-1]], seqs[i][0].num_tokens + j - 1)
                         for i in active]
                for i in active:
                    seqs[i][2].written.append(drafts[i][-1])
            logits = self._forward(feeds)
            tokens, q = self._pick(logits, [seqs[i][0] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None:
                    probs[i].append(q[row])
        for i, (request, _, _) in enumerate(seqs):
            request.spec_token_ids = drafts[i]
            if probs[i] and request.sampling_params.temperature > 0:
                request.spec_probs = torch.stack(probs[i])

    def _forward(self, feeds: list[tuple[_Cached, list[int], int]]) -> torch.Tensor:
        """Logits [sequences, V] after each sequence's last fed token (`feeds`: the cache,
        the tokens, the first one's position). A few tokens per sequence run as one-token
        rows of the compiled decode step; a prompt goes layer by layer."""
        few = 1 + self.config.num_speculative_tokens
        counts = [len(t) if len(t) <= few else 1 for _, t, _ in feeds]
        inputs = StepInputs(
            token_ids=[t for _, tokens, _ in feeds for t in tokens],
            starts=[start for _, _, start in feeds],
            ends=[start + len(tokens) for _, tokens, start in feeds],
            block_ids=[[b.block_id for b in cached.blocks] for cached, _, _ in feeds],
            sample_seqs=list(range(len(feeds))), prompt_seqs=[], prompt_rows=[],
            sample_counts=counts)
        logits = self.runner.run(inputs, b"")[0]
        last = [end - 1 for end in itertools.accumulate(counts)]
        return logits[last, :self.vocab].float()

    def _pick(self, logits: torch.Tensor, requests: list[Request]
              ) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft token (greedy, or drawn under the request's own settings) and,
        for a batch with sampling rows, the distributions drawn from (over the target's
        vocabulary)."""
        tokens, q = self.runner.sampling.draft(logits, requests, self.runner.generator)
        if q is not None and q.shape[1] < self.target_vocab:
            q = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[1]))
        return tokens, q
