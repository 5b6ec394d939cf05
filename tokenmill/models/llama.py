"""The Llama family (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with q/k norm) in one model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata, LogitsRows
from tokenmill.distributed.parallel_state import get_world
from tokenmill.layers import row_chunks
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.host_sync import HostSync, waits_on_host
from tokenmill.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    writable,
)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import (
    MRotaryEmbedding,
    RotaryEmbedding,
    StepRotary,
    head_order,
    rope_parameters,
    rope_parameters_by_layer_type,
    rotary_dim,
)
from tokenmill.layers.stage_layers import make_layers
from tokenmill.layers.state_layer import StateLayer
from tokenmill.models.info import layer_window


class Attention(HostSync, nn.Module):
    """Self-attention over this tensor-parallel rank's heads (all of them with one rank);
    `window`: sliding-window attention (attention/window.py)."""

    stores_values = True  # a K and a V cache (DeepSeek's latent attention: one latent row)

    @property
    def host_sync(self) -> bool:
        """Chunks and sinks run on the masked path, a loop over sequences (no CUDA graph)."""
        return self.chunk is not None or self.sinks is not None

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool,
                 window: int | None = None, softcap: float | None = None,
                 scale: float | None = None, norm: type[nn.Module] = RMSNorm,
                 o_bias: bool | None = None, interleaved: bool = False) -> None:
        """`softcap`: Gemma 2's attention logit soft-capping; `scale`: of the scores (default
        1 / sqrt(head size)); `norm`: the q/k norms' class; `o_bias`: the output
        projection's bias (default the config's `attention_bias`); `interleaved`: rotary on
        pairs (x0, x1), (x2, x3) .. (GLM)."""
        super().__init__()
        self.window, self.softcap = window, softcap
        self.chunk, self.sinks = None, None  # (Llama 4's local chunks, gpt-oss' sinks)
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = scale or self.head_dim ** -0.5
        if o_bias is None:
            o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, o_bias)
        eps = norm_eps(config)
        self.q_norm = norm(self.head_dim, eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, eps) if qk_norm else None
        # partial or interleaved rotary: q and k heads' dimensions reordered for the
        # full-width rotation (layers/rotary.py's head_order)
        order = head_order(self.head_dim, rotary_dim(self.head_dim, rope_parameters(config)),
                           interleaved)
        self.register_buffer("head_order", order, persistent=False)
        # Bound by the model runner once the KV cache is allocated.
        self.backend: AttentionBackend | None = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, rope: StepRotary, x: torch.Tensor, meta: AttentionMetadata,
                logits_rows: LogitsRows | None = None) -> torch.Tensor:
        """Output rows for every token, or only for the `logits_rows` (all rows' K/V cached)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, -1)
        q, k = self.rotate_and_write(rope, qkv, v, meta)
        if logits_rows is not None:  # every row's K/V is cached; only the logits rows attend
            if not logits_rows.count:
                return x.new_empty(0, x.shape[1])
            rows = logits_rows.rows
            q, k, v, meta, t = q[rows], k[rows], v[rows], logits_rows.meta, logits_rows.count
        out = self.backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                  self.window, self.softcap, self.chunk, self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))

    def rotate_and_write(self, rope: StepRotary, qkv: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads, D] normed (with q/k norms) and rotated, K and V cached."""
        t, q_heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        caches = (self.k_cache, self.v_cache, meta.slot_mapping)
        if self.q_norm is None:
            # q and k heads side by side in one view: one rotary pass for both (and, where
            # the backend can, the K/V write in the same kernel)
            qk = self.in_order(qkv[:, : self.q_size + self.kv_size].view(t, q_heads + kv_heads,
                                                                        -1))
            return self.backend.rotate_and_write(rope, qk, v, *caches, q_heads)
        q = rope(self.in_order(self.q_norm(qkv[:, : self.q_size].view(t, q_heads, -1))))
        k = self.in_order(self.k_norm(
            qkv[:, self.q_size: self.q_size + self.kv_size].view(t, kv_heads, -1)))
        return q, self.backend.rotate_and_write(rope, k, v, *caches, 0)[1]

    def in_order(self, heads: torch.Tensor) -> torch.Tensor:
        """Heads [T, H, D] with their dimensions in `head_order` (a copy), or as they are."""
        if self.head_order is None:
            return heads
        return heads.index_select(-1, self.head_order)


def norm_eps(config: Any) -> float:
    """The norms' epsilon: `rms_norm_eps`, or a LayerNorm family's `layer_norm_eps` /
    `norm_epsilon`."""
    for key in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon"):
        if getattr(config, key, None) is not None:
            return float(getattr(config, key))
    return 1e-6


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the intermediate size split across tensor-parallel ranks
    (`reduce=False`: this rank's partial sums, for a caller that adds them up)."""

    def __init__(self, config: Any, size: int | None = None, reduce: bool = True,
                 act: nn.Module | None = None, split: bool = True,
                 bias: bool | None = None) -> None:
        """`act`: the gated activation (default SiLU, which the kernels may fuse); `split`:
        False keeps it whole on this rank (an expert under expert parallel); `bias`: default
        the config's `mlp_bias`."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False) if bias is None else bias
        size = size or config.intermediate_size
        whole = None if split else [(0, size), (0, size)]
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias, whole)
        self.act = act or SiluAndMul()
        self.down_proj = (RowParallelLinear(size, config.hidden_size, bias, reduce) if split
                          else Linear(size, config.hidden_size, bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = row_chunks.mlp_chunk_rows(x, self.gate_up_proj.out_features)
        if rows >= x.shape[0]:
            return self.down_proj(self._gated(x))
        out = torch.empty(x.shape[0], self.down_proj.out_features, dtype=x.dtype)
        for start in range(0, x.shape[0], rows):
            out[start:start + rows] = self.down_proj(self._gated(x[start:start + rows]))
        return out

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T): in one pass where the kernel fuses them."""
        out = (self.gate_up_proj.apply_gated(x)
               if isinstance(self.act, SiluAndMul) else None)
        return out if out is not None else self.act(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = attention  # Attention, or DeepSeek's latent attention
        self.mlp = mlp  # MLP, or a mixture of experts (layers/moe.py)
        self.input_layernorm = norm(config.hidden_size, norm_eps(config))
        self.post_attention_layernorm = norm(config.hidden_size, norm_eps(config))

    def forward(self, rope, hidden, residual, meta, logits_rows: LogitsRows | None = None):
        hidden, residual = self.attend(rope, hidden, residual, meta, logits_rows)
        if logits_rows is not None and not logits_rows.count:
            return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def attend(self, rope, hidden, residual, meta, logits_rows: LogitsRows | None):
        """The input norm (adding the residual carried in) and attention: (attention output,
        residual), of the `logits_rows` only when given."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta, logits_rows)
        if logits_rows is not None:
            residual = residual[logits_rows.rows]
        return hidden, residual


def holds_expert(mlp: nn.Module, name: str) -> bool:
    """Under expert parallel another rank's expert is not read: whether tensor `name` of
    this layer's feed-forward block `mlp` is this rank's."""
    if ".experts." not in name:
        return True
    expert = name.split(".experts.", 1)[1].split(".", 1)[0]
    return not expert.isdigit() or mlp.holds_expert(int(expert))


def _head_cost(config: Any, head_dim: int) -> float:
    """The LM head's weights in decoder layers' worth (a pipeline's last stage holds it)."""
    hidden = config.hidden_size
    attention = hidden * head_dim * (2 * config.num_attention_heads
                                     + 2 * config.num_key_value_heads)
    layer = attention + 3 * hidden * config.intermediate_size
    return config.vocab_size * hidden / layer


class LlamaModel(nn.Module):
    """The decoder; under pipeline parallel only this rank's stage of its layers (`forward`
    then takes the previous stage's hidden states and residual, and hands its own on)."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, max_positions: int,
                 make_mlp: Callable[[Any, int], nn.Module] | None = None,
                 make_attention: Callable[[Any, int], nn.Module] | None = None,
                 make_layer: Callable[..., nn.Module] | None = None,
                 make_norm: type[nn.Module] = RMSNorm, head_here: bool = True) -> None:
        super().__init__()
        make_mlp = make_mlp or (lambda config, layer: MLP(config))
        make_layer = make_layer or DecoderLayer
        make_attention = make_attention or (
            lambda config, layer: Attention(config, qkv_bias, qk_norm,
                                            layer_window(config, layer)))
        world = get_world()
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        self.is_first_stage, self.is_last_stage = world.is_first_stage, world.is_last_stage
        by_type = rope_parameters_by_layer_type(config)
        if by_type is None:
            params = rope_parameters(config)
            rotary = MRotaryEmbedding if "mrope_section" in params else RotaryEmbedding
            self.rotary = rotary(head_dim, max_positions, params, config.max_position_embeddings)
            self.rotaries, self.layer_types = None, None
        else:  # Gemma 3: local and global layers rotate with their own settings
            self.rotaries = nn.ModuleDict({kind: RotaryEmbedding(
                head_dim, max_positions, params, config.max_position_embeddings)
                for kind, params in by_type.items()})
            self.layer_types = list(config.layer_types)
            self.rotary = self.rotaries["full_attention"]
        # the embedding on the first stage (and with a tied LM head: its table)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if world.is_first_stage or (tied and head_here) else None)
        self.stage_layers, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: make_layer(config, make_attention(config, i), make_mlp(config, i)),
            _head_cost(config, head_dim))
        self.norm = make_norm(config.hidden_size, norm_eps(config))
        self.embed_scale: float | None = None

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows of `input_ids` (an image-text model's runner puts its
        images' rows in among them: worker/mm_encoder.py)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: embeddings times sqrt(hidden size)
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids, positions, meta, logits_rows: LogitsRows | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """Final hidden states of every token, or only of the `logits_rows`: no later layer reads
        the last layer's outputs, so there only the logits rows go past the K/V projection
        (most of a prompt's rows are not sampled from). A stage before the last returns its
        (hidden, residual) instead; a stage after the first starts from `intermediate`."""
        if intermediate is None:
            hidden, residual = self.embed_input(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary.for_step(positions, hidden.dtype)
        ropes = None if self.rotaries is None else {
            kind: rotary.for_step(positions, hidden.dtype)
            for kind, rotary in self.rotaries.items()}
        last = len(self.layers) - 1
        for i in self.stage_layers:
            layer_rope = rope if ropes is None else ropes[self.layer_types[i]]
            hidden, residual = self.layers[i](layer_rope, hidden, residual, meta,
                                              logits_rows if i == last else None)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage (layers of other stages
        are not read)."""
        if name.startswith("model.embed_tokens."):
            return self.embed_tokens is not None
        if not name.startswith("model.layers."):
            return True
        layer = int(name.split(".", 3)[2])
        if layer not in self.stage_layers:
            return False
        return holds_expert(self.layers[layer].mlp, name)


class LlamaForCausalLM(nn.Module):
    head_bias = False  # (Phi-2's LM head has a bias)
    # (our merged parameter, checkpoint name, shard index)
    stacked_params = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1),
                      ("qkv_proj", "v_proj", 2), ("gate_up_proj", "gate_proj", 0),
                      ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config: Any, max_positions: int, qkv_bias: bool = False,
                 qk_norm: bool = False,
                 make_mlp: Callable[[Any, int], nn.Module] | None = None,
                 make_attention: Callable[[Any, int], nn.Module] | None = None,
                 make_layer: Callable[..., nn.Module] | None = None,
                 make_norm: type[nn.Module] = RMSNorm,
                 head_on_first_stage: bool = False) -> None:
        """`make_mlp(config, layer index)` / `make_attention(...)`: each layer's feed-forward
        and attention blocks (default MLP and Attention); `make_layer(config, attention,
        mlp)`: the decoder layer around them; `make_norm`: the final norm's class.
        Under pipeline parallel the embedding lives on the first stage and the LM head on the
        last (`head_on_first_stage`: on the first too, for draft heads running there)."""
        super().__init__()
        self.config = config
        world = get_world()
        head_here = world.is_last_stage or (head_on_first_stage and world.is_first_stage)
        self.model = LlamaModel(config, qkv_bias, qk_norm, max_positions, make_mlp,
                                make_attention, make_layer, make_norm, head_here)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if head_here or (self.tie_word_embeddings and self.model.embed_tokens is not None):
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, self.head_bias)
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, logits_rows: LogitsRows | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, meta, logits_rows, intermediate)

    def holds(self, name: str) -> bool:
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return self.model.holds(name)

    def unread(self, name: str) -> bool:
        """Whether parameter `name` of a rank's file is left unread by choice: an LM head or
        embedding this stage does without (a folder's stage 0 keeps the LM head for draft
        heads)."""
        return name.startswith(("lm_head.", "model.embed_tokens.")) and not self.holds(name)

    @property
    def graphable(self) -> bool:
        """Whether a step's forward runs without waiting on the host (a CUDA graph can hold
        it): not with mixture-of-experts layers or latent attention (`HostSync`)."""
        return not waits_on_host(*(self.model.layers[i] for i in self.model.stage_layers))

    def mtp_layers(self) -> list[nn.Module]:
        """Its multi-token-prediction layers (DeepSeek's), which can run as draft heads."""
        return []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary on tensor-parallel rank 0; None on the others."""
        return self.lm_head.logits(hidden)

    def attention_layers(self) -> list[Attention]:
        """This stage's K/V-caching layers (not its state layers: worker/state_cache.py)."""
        mixers = (self.model.layers[i].self_attn for i in self.model.stage_layers)
        return [m for m in mixers if not isinstance(m, StateLayer)]

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """Checkpoint tensor name -> (our parameter name, shard index in a merged layer)."""
        for merged, original, shard in self.stacked_params:
            if f".{original}." in name:
                return name.replace(f".{original}.", f".{merged}."), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} matches no model parameter.")
            param = params[target] = writable(self, target, params[target])
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        return loaded

    def finish_loading(self, loaded: set[str]) -> None:
        """Called once with every parameter name loaded (from a checkpoint, or a rank's
        pre-sharded file), before the missing ones are named."""
