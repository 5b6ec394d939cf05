"""The compiled decode step (csrc/decode_step.c): every decoder layer of a Llama-family model
in one C call when a step is all decodes of up to `max_rows` (64) sequences on the CPU.

At batch 1 a decoder layer is ~12 kernel calls; from Python each costs module, dispatch and
ctypes work, which added up to about as long as streaming the layer's weights (bench/NOTES.md).
`CpuDecodeStep.build` describes the model's tensors to C once (weights, norms, KV caches,
rotary tables, scratch rows); each eligible step then passes only its token rows and
attention metadata. It runs the same kernels in the same order as the Python path, so outputs
are the same; steps it does not take (prompts, more rows, other kernels) run layer by layer."""

from __future__ import annotations

import ctypes
import logging

import torch

from tokenmill import csrc
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import kernels as kernel_switches
from tokenmill.distributed.parallel_state import get_tp_group
from tokenmill.distributed.shm_allreduce import SLOT_FLOATS
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.state_layer import StateLayer
from tokenmill.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from tokenmill.quantization.linear_kernels import PartsKernel

logger = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("param", _i64), ("w", _ptr),
                ("scale", _ptr), ("min", _ptr), ("bias", _ptr), ("lora", _ptr)]


class _Lora(ctypes.Structure):  # a layer's LoRA slots (decode_step.c's tm_lora)
    _fields_ = [("at", _ptr), ("bt", _ptr), ("ldb", _i64), ("width", _i64), ("slices", _i64),
                ("offsets", _ptr), ("ranks", _ptr)]


class _Moe(ctypes.Structure):
    _fields_ = ([(name, _i64) for name in ("num_experts", "top_k", "renormalize", "inter",
                                           "shared_inter")]
                + [("scaling", _f32), ("router", _Linear), ("gate_up", ctypes.POINTER(_Linear)),
                   ("down", ctypes.POINTER(_Linear)), ("shared_gate_up", _Linear),
                   ("shared_down", _Linear), ("shared_gate", _ptr)])


class _Scratch(ctypes.Structure):  # one thread's (decode_step.c's tm_scratch)
    _fields_ = [(name, _ptr) for name in ("gate_up", "act", "xs", "xsum", "rows_in",
                                          "part_out", "xq", "hsum", "lora_slots", "lora_tmp")]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("moe", ctypes.POINTER(_Moe))]


class _Model(ctypes.Structure):
    _fields_ = ([(name, _i64) for name in ("num_layers", "hidden", "q_heads", "kv_heads",
                                           "head_dim", "intermediate", "block_size", "kv_kind",
                                           "max_rows")]
                + [("eps", _f32), ("scale", _f32), ("layers", ctypes.POINTER(_Layer))]
                + [(name, _ptr) for name in ("final_norm", "cos", "signed_sin", "residual",
                                             "normed", "qkv", "attn")]
                + [("scratch", _Scratch)]
                + [(name, _i64) for name in ("tp_rank", "tp_size", "slot_floats")]
                + [("shm_base", _ptr), ("shm_seq", _ptr), ("first_stage", _i64),
                   ("last_stage", _i64)]
                + [(name, _ptr) for name in ("logits", "route_w", "row_w", "expert_out",
                                             "rows_out", "route_ids", "rows", "expert_first",
                                             "expert_scratch")]
                + [("expert_threads", _i64)])

def _pointers(scratch: dict[str, torch.Tensor]) -> _Scratch:
    return _Scratch(**{name: t.data_ptr() for name, t in scratch.items()})


_NONE = _Linear(kind=-1)  # an expert another rank holds; no shared expert / gate


def _mlps(layer: torch.nn.Module) -> list[MLP]:
    """The MLPs of a layer's feed-forward block: itself, or its experts and shared expert."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoE):
        return [mlp]
    return [e for e in mlp.experts if isinstance(e, MLP)] + (
        [mlp.shared_expert] if mlp.shared_expert is not None else [])


def _linear(layer: Linear) -> tuple[_Linear, int] | None:
    """The layer for C and the most rows its compiled kernel is the fastest for."""
    if isinstance(layer.kernel, PartsKernel):
        return _parts(layer)
    form = layer.kernel.compiled_form()
    if form is None:
        return None
    n, k = layer.out_features, layer.in_features
    return _Linear(form.kind, n, k, form.param, form.weight, form.scale, form.min,
                   csrc.address(layer.bias)), form.max_rows


def _parts(layer: Linear) -> tuple[_Linear, int] | None:
    """A merged layer whose parts have kernels of their own (decode_step.c's PARTS)."""
    kernel = layer.kernel
    forms = [part.compiled_form() for part in kernel.parts]
    if not all(forms):
        return None
    start, described = 0, []
    for form, n in zip(forms, kernel.sizes):
        bias = None if layer.bias is None else layer.bias.data_ptr() + 4 * start
        described.append(_Linear(form.kind, n, layer.in_features, form.param, form.weight,
                                 form.scale, form.min, bias))
        start += n
    kernel.compiled_parts = (_Linear * len(described))(*described)  # (kept alive there)
    return _Linear(csrc.PARTS, layer.out_features, layer.in_features, len(described),
                   ctypes.addressof(kernel.compiled_parts), None, None,
                   csrc.address(layer.bias)), min(form.max_rows for form in forms)


class CpuDecodeStep:
    # Most decode rows a step takes, whatever the kernels allow: the layers' Python overhead
    # matters less as rows grow, and the scratch rows are allocated for this many.
    ROW_CAP = 64

    def __init__(self, model: LlamaForCausalLM, layers: list[_Layer], max_rows: int) -> None:
        inner = model.model
        stage = [inner.layers[i] for i in inner.stage_layers]  # (pipeline parallel: ours)
        attn = stage[0].self_attn
        config = model.config
        # Decode rows up to which steps run compiled: the smallest row limit of the layers'
        # kernels (fp32: any; int8 128 and int4 64 rows, above which the weights are unpacked
        # into fp32 panels: quantization/linear_kernels.py); at most ROW_CAP.
        self.max_rows = max_rows
        rows, hidden = max_rows, config.hidden_size
        # this rank's share of the dense MLPs' intermediate size, and the largest of any MLP
        dense = [layer.mlp.down_proj.in_features for layer in stage
                 if not isinstance(layer.mlp, SparseMoE)]
        inter = max(m.down_proj.in_features for layer in stage for m in _mlps(layer))
        moes = [layer.mlp for layer in stage if isinstance(layer.mlp, SparseMoE)]
        experts = max([len(m.experts) for m in moes], default=1)
        top_k = max([m.top_k for m in moes], default=1)
        width = attn.q_size + 2 * attn.kv_size
        max_k = max(hidden, attn.q_size, inter)
        self._embed = inner.embed_tokens  # (vocab-parallel: its own all-reduce)
        self._attention = [layer.self_attn for layer in stage]
        self._first_stage, self._last_stage = inner.stage_layers[0] == 0, inner.is_last_stage
        self._caches = [(a.k_cache, a.v_cache) for a in self._attention]
        # Scratch rows the C step writes; kept for the model's lifetime.
        self._scratch = {
            "residual": torch.empty(rows, hidden), "normed": torch.empty(rows, hidden),
            "qkv": torch.empty(rows, width), "attn": torch.empty(rows, attn.q_size),
            "logits": torch.empty(rows, experts), "route_w": torch.empty(rows, top_k),
            "row_w": torch.empty(rows * top_k), "expert_out": torch.empty(rows * top_k, hidden),
            "rows_out": torch.empty(rows, hidden),
            "route_ids": torch.empty(rows, top_k, dtype=torch.int64),
            "rows": torch.empty(rows * top_k, dtype=torch.int64),
            "expert_first": torch.empty(experts + 1, dtype=torch.int64)}
        # experts run side by side, one per thread, each with its own scratch
        self._main = self._mlp_scratch(rows, hidden, inter, max_k, max(width, 2 * inter))
        self._threads = [self._mlp_scratch(rows, hidden, inter, max_k, 2 * inter)
                         for _ in range(torch.get_num_threads() if moes else 0)]
        self._thread_scratch = (_Scratch * max(1, len(self._threads)))(*(
            _pointers(s) for s in self._threads))
        self._described = layers  # (each keeps its experts' descriptions alive)
        self._layers = (_Layer * len(layers))(*layers)
        # LoRA (`lora`: the runner's LoRAManager, None without --enable-lora): the layers
        # adapters may target, by (layer, field); their slots described once they exist
        self.lora = None
        self._adaptable = [(i, field, module) for i, layer in enumerate(stage)
                           for field, module in (("qkv", layer.self_attn.qkv_proj),
                                                 ("o", layer.self_attn.o_proj),
                                                 *(() if isinstance(layer.mlp, SparseMoE) else
                                                   (("gate_up", layer.mlp.gate_up_proj),
                                                    ("down", layer.mlp.down_proj))))]
        self._loras: dict[int, tuple] = {}  # id(module) -> its _Lora and what it points to
        self._lora_count = 0
        self._lora_slots = torch.full((max_rows,), -1, dtype=torch.int64)
        self._lora_tmp = torch.empty(0)
        rotary = inner.rotary
        self._model = _Model(
            num_layers=len(layers), hidden=hidden, q_heads=attn.num_heads,
            kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=dense[0] if dense else 0,
            block_size=attn.k_cache.shape[1], kv_kind=csrc.kv_kind(attn.k_cache),
            max_rows=rows,
            eps=inner.norm.eps, scale=attn.scale, layers=self._layers,
            final_norm=inner.norm.weight.data_ptr(), cos=rotary.cos.data_ptr(),
            signed_sin=rotary.signed_sin.data_ptr(),
            **{name: t.data_ptr() for name, t in self._scratch.items()},
            scratch=_pointers(self._main),
            expert_scratch=ctypes.cast(self._thread_scratch, _ptr),
            expert_threads=len(self._threads),
            **self._tensor_parallel(get_tp_group()),
            first_stage=int(self._first_stage), last_stage=int(self._last_stage))

    @staticmethod
    def _mlp_scratch(rows: int, hidden: int, inter: int, max_k: int, widest: int) -> dict:
        """One thread's scratch rows for its linear layers and MLPs (tm_scratch); `widest`:
        the most outputs of a merged layer whose parts run apart."""
        blocks = max_k // 32 + 1
        return {"gate_up": torch.empty(rows, 2 * inter), "act": torch.empty(rows, inter),
                "xs": torch.empty(rows, blocks), "xsum": torch.empty(rows, blocks),
                "rows_in": torch.empty(rows, hidden), "part_out": torch.empty(rows, widest),
                "xq": torch.empty(rows, max_k, dtype=torch.int16),
                "hsum": torch.empty(rows, 2 * blocks, dtype=torch.int32)}

    @staticmethod
    def _tensor_parallel(tp) -> dict:
        if tp.size == 1:
            return {"tp_rank": 0, "tp_size": 1, "slot_floats": 0}
        return {"tp_rank": tp.rank, "tp_size": tp.size, "slot_floats": SLOT_FLOATS,
                "shm_base": tp.shm.base, "shm_seq": ctypes.addressof(tp.shm.seq)}

    @classmethod
    def build(cls, model: torch.nn.Module, backend: object) -> CpuDecodeStep | None:
        """The compiled step for this model, or None where it cannot run (then every step goes
        through the model's Python forward)."""
        reason = cls._unsupported(model, backend)
        if reason is None:
            described = [cls._describe(model.model.layers[i])
                         for i in model.model.stage_layers]
            if all(described):
                layers = [layer for layer, _ in described]
                max_rows = min([cls.ROW_CAP] + [rows for _, rows in described])
                return cls(model, layers, max_rows)
            reason = "a linear layer's kernel has no compiled form"
        logger.info("Decode steps run layer by layer: %s.", reason)
        return None

    @staticmethod
    def _unsupported(model: torch.nn.Module, backend: object) -> str | None:
        if not kernel_switches.current().cpu.decode_step:
            return "TOKENMILL_CPU_DECODE_STEP=0"
        if not isinstance(model, LlamaForCausalLM):
            return f"no compiled step for {type(model).__name__}"
        tp = get_tp_group()
        if tp.size > 1 and tp.shm is None:
            return "tensor-parallel ranks without the shared-memory all-reduce"
        if not csrc.usable(model.model.norm.weight):  # (the compute dtype and device)
            return "the compiled kernels need float32 weights on a CPU with AVX2"
        if not (isinstance(backend, TorchSDPABackend) and backend.use_compiled_decode):
            return "the attention backend does not use the compiled decode kernel"
        stage = [model.model.layers[i] for i in model.model.stage_layers]
        if any(isinstance(layer.self_attn, StateLayer) for layer in stage):
            return "state layers (Mamba-2, gated DeltaNet) run in Python"
        if not all(type(layer) is DecoderLayer for layer in stage):
            return "this decoder layer's norms run in Python"
        if any(isinstance(layer.mlp, SparseMoE) and layer.mlp.router != "softmax"
               for layer in stage):
            return "DeepSeek's grouped routers run in Python"
        if not all(isinstance(layer.mlp, (MLP, SparseMoE)) for layer in stage):
            return "this feed-forward block runs in Python"
        if not all(isinstance(m.act, SiluAndMul) for layer in stage for m in _mlps(layer)):
            return "activations other than SiLU run in Python"
        if any(getattr(layer.self_attn, "k_cache", None) is not None
               and layer.self_attn.k_cache.dtype not in csrc.KV_KINDS
               for layer in stage):
            return "the compiled kernels read float32, bfloat16 or int8 K/V caches"
        if not all(isinstance(layer.self_attn, Attention) for layer in stage):
            return "latent attention runs in Python"
        if any(layer.self_attn.head_order is not None for layer in stage):
            return "partial or interleaved rotary runs in Python"
        if any(a.window is not None or a.softcap is not None or a.chunk is not None
               or a.sinks is not None for a in (layer.self_attn for layer in stage)):
            return "sliding-window, chunked, soft-capped and sink attention run in Python"
        if stage[0].self_attn.head_dim % 8:
            return "head size not a multiple of 8"
        # decode_step.c applies one epsilon to every RMSNorm, the q/k head norms included.
        norms = [model.model.norm] + [n for layer in stage
                                      for n in (layer.input_layernorm,
                                                layer.post_attention_layernorm,
                                                layer.self_attn.q_norm, layer.self_attn.k_norm)
                                      if n is not None]
        if any(n.eps != model.model.norm.eps for n in norms):
            return "the layers' RMSNorm epsilons differ"
        return None

    @staticmethod
    def _describe(layer: torch.nn.Module) -> tuple[_Layer, int] | None:
        attn, mlp = layer.self_attn, layer.mlp
        moe = mlp if isinstance(mlp, SparseMoE) else None
        dense = [] if moe else [mlp.gate_up_proj, mlp.down_proj]
        forms = [_linear(m) for m in [attn.qkv_proj, attn.o_proj, *dense]]
        described = None if moe is None else CpuDecodeStep._describe_moe(moe)
        if not all(forms) or (moe is not None and described is None):
            return None
        linears = [linear for linear, _ in forms] + ([_NONE, _NONE] if moe else [])
        q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        rows = min([r for _, r in forms] + ([described[1]] if described else []))
        struct = _Layer(*linears, layer.input_layernorm.weight.data_ptr(),
                        layer.post_attention_layernorm.weight.data_ptr(), q_norm, k_norm,
                        attn.k_cache.data_ptr(), attn.v_cache.data_ptr(),
                        ctypes.pointer(described[0]) if described else None)
        struct.keep = described
        return struct, rows

    @staticmethod
    def _describe_moe(moe: SparseMoE) -> tuple[_Moe, int] | None:
        """The block for C (see decode_step.c's tm_moe) and its kernels' row limit."""
        pairs = [(e.gate_up_proj, e.down_proj) if isinstance(e, MLP) else None
                 for e in moe.experts]
        shared = moe.shared_expert
        linears = [moe.gate] + [m for pair in pairs if pair for m in pair] + (
            [shared.gate_up_proj, shared.down_proj] if shared is not None else [])
        forms = {id(m): _linear(m) for m in linears}
        if not all(forms.values()):
            return None

        def form(m):
            return _NONE if m is None else forms[id(m)][0]
        gate_up = (_Linear * len(pairs))(*(form(p and p[0]) for p in pairs))
        down = (_Linear * len(pairs))(*(form(p and p[1]) for p in pairs))
        held = next(p for p in pairs if p)
        struct = _Moe(num_experts=len(pairs), top_k=moe.top_k,
                      renormalize=int(moe.renormalize), inter=held[1].in_features,
                      shared_inter=shared.down_proj.in_features if shared else 0,
                      scaling=moe.grouped[2], router=form(moe.gate), gate_up=gate_up,
                      down=down, shared_gate_up=form(shared and shared.gate_up_proj),
                      shared_down=form(shared and shared.down_proj),
                      shared_gate=csrc.address(moe.shared_expert_gate
                                               and moe.shared_expert_gate.weight))
        struct.keep = (gate_up, down)
        return struct, min(rows for _, rows in forms.values())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata,
                 intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                 drafted: bool = False):
        """The final hidden states [T, H] of an all-decode step of at most `max_rows` tokens
        (new K/V written to the caches); None for any other step. `drafted`: the step's
        sequences of several tokens are decodes with draft tokens (speculative decoding),
        whose rows are then decodes of their own: each attends to the positions up to it
        (every row's K/V is written before any row attends), the same arithmetic as
        decoding them one at a time. A pipeline stage after the first starts from the
        previous one's `intermediate` (hidden, residual); one before the last returns its own
        (hidden, residual), as the model's forward does."""
        t = input_ids.shape[0]
        if (meta.num_decodes != meta.num_seqs and not drafted) or t > self.max_rows:
            return None
        if any(a.k_cache is not k or a.v_cache is not v
               for a, (k, v) in zip(self._attention, self._caches)):
            return None  # caches were rebound after build: the described addresses are stale
        residual = self._scratch["residual"][:t]
        if intermediate is None:
            hidden = self._embed(input_ids)
        else:
            hidden = intermediate[0].contiguous()
            residual.copy_(intermediate[1])
        out = torch.empty_like(hidden)
        table, seq_lens = meta.block_table, meta.seq_lens
        if meta.num_decodes != meta.num_seqs:  # drafted: a block table and length a row
            starts = meta.query_start_loc
            counts = torch.tensor([b - a for a, b in zip(starts, starts[1:])])
            table = table[torch.repeat_interleave(torch.arange(len(counts)), counts)]
            seq_lens = positions + 1
        assert table.stride(1) == 1 and positions.is_contiguous()
        self._model.scratch.lora_slots = self._step_loras(t)
        status = csrc.library().tm_decode_layers(
            ctypes.byref(self._model), hidden.data_ptr(), out.data_ptr(), t,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), table.data_ptr(),
            table.stride(0), seq_lens.data_ptr())
        if status == -2:
            raise RuntimeError("A tensor-parallel rank died during an all-reduce.")
        return out if self._last_stage else (hidden, residual.clone())

    def _step_loras(self, rows: int) -> int | None:
        """This step's row slots for C (None: no row has an adapter), the adapters' layers
        described first where they are new."""
        batch = None if self.lora is None else self.lora.batch
        if batch is None or not batch.active:
            return None
        if self._lora_count != len(self.lora.layers):  # (layers get slots as adapters come)
            self._lora_count = len(self.lora.layers)
            self._describe_loras()
        self._lora_slots[:rows] = torch.from_numpy(batch.slot_of_row[:rows])
        return self._lora_slots.data_ptr()

    def _describe_loras(self) -> None:
        """Points each adapted layer's description at its LoRA slots (lora/layers.py)."""
        for i, field, module in self._adaptable:
            slots = module.lora
            if slots is None or id(module) in self._loras:
                continue
            offsets = slots.offsets_t
            struct = _Lora(slots.at.data_ptr(), slots.bt.data_ptr(), slots.bt.shape[-1],
                           slots.width,
                           len(slots.offsets) - 1, offsets.data_ptr(), slots.ranks.data_ptr())
            self._loras[id(module)] = (struct, offsets, slots)
            getattr(self._layers[i], field).lora = ctypes.addressof(struct)
            if slots.width > self._lora_tmp.shape[-1]:
                self._lora_tmp = torch.empty(self.max_rows, slots.width)
                self._model.scratch.lora_tmp = self._lora_tmp.data_ptr()
