"""Which of a model runner's steps run as CUDA graphs: the decode buckets (cuda_graphs.py)
and the piecewise graphs of other steps (piecewise_graphs.py), captured at start-up where the
device, backend and model allow, with every tensor-parallel rank agreeing on each capture."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.piecewise_graphs import PiecewiseGraphs, piece_sizes

logger = logging.getLogger(__name__)


def agreed(tp: Any, flag: bool) -> bool:
    """Whether every tensor-parallel rank says `flag`: asked before each capture and after
    it, so that every rank captures (its collectives pair up with the others') or none
    does, and every rank keeps what it captured or none does (each step, every rank must
    take the same path)."""
    return bool(tp.all_reduce_min(int(flag)))


def build(runner: Any, max_model_len: int) -> tuple[DecodeGraphs | None, Any]:
    """A model runner's steps as CUDA graphs where they can be (one pipeline stage, the
    Triton backend, a model whose forward has no host syncs): decode steps in `DecodeGraphs`
    (with speculative decoding, steps whose every sequence carries all k drafts too; they
    give what MTP / EAGLE heads read), and the other steps of up to the token budget (2048
    at most) in pieces (piecewise_graphs.py; TOKENMILL_GPU_PIECEWISE_GRAPHS=0: eagerly).
    Tensor-parallel ranks capture the same buckets in the same order, their collectives
    inside (NCCL's captured collectives: every rank replays the same graph each step).
    (None, None) where there are none."""
    config, settings, tp = runner.config, runner.config.kernels.gpu, runner.tp
    if not agreed(tp, (runner.platform.supports_graphs or settings.cpu_graph_buckets)
                  and not config.enforce_eager and runner.world.pp_size == 1
                  and runner.decode_step is None and runner.backend.graph_safe
                  and runner.pooler is None
                  and runner.model.graphable):
        return None, None
    spec = config.speculative_config  # (steps carrying drafts: their own buckets)
    capture = runner.device.type == "cuda"
    aux = runner.target_states.aux_hidden if runner.target_states else None
    graphs = pieces = None
    try:
        with torch.inference_mode():
            graphs = DecodeGraphs(runner.model, runner.backend, runner.device,
                                  runner.block_size, config.max_num_seqs, max_model_len,
                                  capture, drafts=spec.num_speculative_tokens if spec else 0,
                                  drafted_seqs=spec.disable_by_batch_size if spec else 0,
                                  aux=aux)
    except RuntimeError as exc:  # (a forward that cannot be captured: run it eagerly)
        logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", exc)
    if not agreed(tp, graphs is not None):
        return None, None
    logger.info("Decode steps as CUDA graphs for batch sizes %s", ", ".join(
        f"{sizes} ({q} rows a sequence)" for q, sizes in graphs.widths.items()))
    if not agreed(tp, settings.piecewise_graphs):
        return graphs, None
    try:
        with torch.inference_mode():
            pieces = PiecewiseGraphs(runner.model, runner.backend, runner.device,
                                     runner.block_size,
                                     piece_sizes(config.token_budget(max_model_len)),
                                     capture, graphs.pool, aux)
    except Exception as exc:  # noqa: BLE001 (any failure leaves these steps eager, logged)
        logger.warning("Piecewise CUDA graph capture failed (%s: %s); steps other than "
                       "decodes run eagerly", type(exc).__name__, exc)
    if not agreed(tp, pieces is not None):
        return graphs, None
    logger.info("Other steps of up to %d tokens as CUDA graphs in pieces (between attention "
                "calls) for token counts %s", pieces.sizes[-1], pieces.sizes)
    return graphs, pieces
