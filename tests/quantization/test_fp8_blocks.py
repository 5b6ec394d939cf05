"""Block-scaled FP8 checkpoints (DeepSeek-V3 / R1's release format): each float8 weight
times its block's `weight_scale_inv` factor, on one rank (whole tensors) and two (each
rank's rows or columns, their blocks' factors cut to match); loaded as float weights, or
kept as float8 (`Fp8BlockKernel`, TOKENMILL_FP8_BLOCKS=keep; the default on GPUs) and
multiplied by the Triton kernels (run by its interpreter where there is no GPU), both ways
they read float8: the card's conversion and bytes decoded in registers (A100s)."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.quantization import fp8_blocks as blocks
from tokenmill.quantization.fp8_blocks import Fp8BlockKernel

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
BLOCK = (32, 48)  # rows, columns: the tiny layers hold several, some partial
KEPT_BLOCK = (32, 32)  # columns in whole groups of 32: kept as float8 where asked
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    scale = torch.empty(rows, columns)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(columns):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_checkpoint(tmp_path, tiny_models, arch: str, block) -> tuple[str, object]:
    """A block-FP8 copy of a tiny model's checkpoint (its projections' weights), and the
    transformers model over the weights that copy stands for (saved as a float checkpoint
    of the same tensors, read back as transformers reads checkpoints)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src, _ = tiny_models(arch)
    out, ref = tmp_path / f"fp8-{arch}-{block[1]}", tmp_path / f"ref-{arch}-{block[1]}"
    out.mkdir()
    ref.mkdir()
    state, rounded = {}, {}
    for name, tensor in load_file(f"{src}/model.safetensors").items():
        rounded[name] = state[name] = tensor.contiguous()
        if name.endswith("proj.weight"):
            q, scale = fp8_blocks(tensor, block)
            state[name], state[name + "_scale_inv"] = q, scale
            rounded[name] = blocks.dequantize(q, scale, block)
    save_file(state, str(out / "model.safetensors"))
    save_file(rounded, str(ref / "model.safetensors"))
    with open(f"{src}/config.json") as f:
        config = json.load(f)
    (ref / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", out / name)
    hf = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
    return str(out), hf.eval()


@pytest.mark.parametrize("arch,block,keep", [
    ("qwen2", BLOCK, "auto"),  # (dequantized on CPUs)
    ("qwen2", BLOCK, "keep"),  # (columns in groups of 48: dequantized all the same)
    ("qwen2", KEPT_BLOCK, "keep"),
    # MLA's kv_b_proj (read as a float weight) and q_b_proj (48 inputs) dequantized, the
    # experts, shared expert and the other projections kept
    ("deepseek_v3", KEPT_BLOCK, "keep")])
def test_block_fp8_checkpoint_serves_the_weights_it_stands_for(tmp_path, tiny_models,
                                                              monkeypatch, arch, block, keep):
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", keep)  # (the ranks' processes inherit it)
    path, hf = fp8_checkpoint(tmp_path, tiny_models, arch, block)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [hf_greedy(hf, p, 10) for p in PROMPTS]
    for tp in (1, 2):
        with LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=tp) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, tp


def _kernels(path: str, monkeypatch) -> tuple[dict[str, str], int, set[str]]:
    """Each linear's kernel, the weights' bytes and the linears given float memory."""
    from tokenmill.layers import linear
    from tokenmill.loading.checkpoint import load_hf_config, load_model
    from tokenmill.quantization import model as qmodel

    given, original = [], linear.materialized
    for module in (linear, qmodel):  # (the models' loaders reach it through `writable`)
        monkeypatch.setattr(module, "materialized",
                            lambda layer: given.append(layer) or original(layer))
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), 64)
    names = {id(module): name for name, module in model.named_modules()}
    return ({name: module.kernel.name for name, module in model.named_modules()
             if hasattr(module, "kernel")}, qmodel.weight_bytes(model),
            {names[id(layer)] for layer in given})


def test_kept_layers_are_float8_where_their_groups_allow(tmp_path, tiny_models, monkeypatch):
    path, _ = fp8_checkpoint(tmp_path, tiny_models, "deepseek_v3", KEPT_BLOCK)
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "keep")
    kept, kept_bytes, given = _kernels(path, monkeypatch)
    # only the layers that hold a float weight ever had memory for one (the others were
    # built without: DeepSeek-R1's would not fit as bf16 before their float8 replaced them)
    assert given == {name for name, kernel in kept.items() if not kernel.startswith("fp8")}
    assert "model.layers.1.self_attn.kv_b_proj" in given
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "dequantize")
    _, float_bytes, _ = _kernels(path, monkeypatch)
    layer = "model.layers.1."
    assert kept[layer + "mlp.experts.3.gate_up_proj"] == "fp8-block-dequant"  # (the CPU's)
    assert kept[layer + "mlp.experts.3.down_proj"] == "fp8-block-dequant"
    assert kept[layer + "mlp.shared_expert.gate_up_proj"] == "fp8-block-dequant"
    assert kept[layer + "self_attn.o_proj"] == "fp8-block-dequant"
    assert kept[layer + "self_attn.q_a_proj"] == "fp8-block-dequant"
    assert not kept[layer + "self_attn.q_b_proj"].startswith("fp8")  # 48 inputs
    assert not kept[layer + "self_attn.kv_b_proj"].startswith("fp8")  # read as float
    assert not kept[layer + "mlp.gate"].startswith("fp8")  # (float in the checkpoint)
    # the experts' float32 weights (4 bytes) became one byte and a scale per 32
    assert kept_bytes < float_bytes * 0.7


def test_bad_fp8_blocks_setting_is_named(monkeypatch):
    from tokenmill.config.kernels import GpuKernelSettings

    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_FP8_BLOCKS must be auto, keep or"):
        GpuKernelSettings.from_env()



def test_sharded_folder_keeps_float8(tmp_path, tiny_models, monkeypatch):
    """`tokenmill convert --tp-size 2` of a block-FP8 DeepSeek-V3: each rank's file holds its
    layers' float8 bytes and scales (the float ones, as MLA's kv_b_proj, as float), and the
    folder serves the weights the original stands for, kept as float8 and dequantized; with
    TOKENMILL_FP8_BLOCKS=dequantize the files are float, as before; quantizing float8 files
    at load (no whole rows' maxima) is refused by name."""
    from safetensors import safe_open

    from tokenmill.distributed.parallel_state import as_rank
    from tokenmill.entrypoints.cli import main as cli
    from tokenmill.loading.checkpoint import load_hf_config, load_model
    from tokenmill.loading.sharded import rank_file

    path, hf = fp8_checkpoint(tmp_path, tiny_models, "deepseek_v3", KEPT_BLOCK)
    kept, floats = str(tmp_path / "tp2"), str(tmp_path / "tp2-float")
    assert cli(["convert", path, kept, "--tp-size", "2"]) == 0
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "dequantize")
    assert cli(["convert", path, floats, "--tp-size", "2"]) == 0
    layer = "model.layers.1."
    with safe_open(f"{kept}/{rank_file(1)}", "pt") as f:
        assert f.get_slice(layer + "mlp.experts.3.down_proj.qweight").get_dtype() == "F8_E4M3"
        assert f.get_slice(layer + "self_attn.kv_b_proj.weight").get_dtype() == "F32"
    with safe_open(f"{floats}/{rank_file(1)}", "pt") as f:
        assert f.get_slice(layer + "mlp.experts.3.down_proj.weight").get_dtype() == "F32"
    for r in range(2):
        assert os.path.getsize(f"{kept}/{rank_file(r)}") < \
            0.7 * os.path.getsize(f"{floats}/{rank_file(r)}")
    # rank 1 from its file: the same float8 layers and bytes as when cut from the original
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "keep")
    cpu = torch.device("cpu")
    with as_rank(1, 2):
        ours, theirs = (load_model(p, load_hf_config(p), torch.float32, cpu, 64)
                        for p in (kept, path))
        for (name, a), (_, b) in zip(ours.named_modules(), theirs.named_modules()):
            if hasattr(a, "kernel") and a.kernel.name.startswith("fp8"):
                assert torch.equal(a.kernel.qweight.view(torch.uint8),
                                   b.kernel.qweight.view(torch.uint8)), name
                assert torch.equal(a.kernel.scale, b.kernel.scale), name
            elif hasattr(a, "kernel"):
                assert not b.kernel.name.startswith("fp8"), name
        assert ours.model.layers[1].mlp.experts[3].down_proj.kernel.name.startswith("fp8")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [hf_greedy(hf, p, 10) for p in PROMPTS]
    for keep in ("keep", "auto"):  # (auto on CPUs: dequantized as each rank loads)
        monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", keep)
        with LLM(kept, kv_cache_memory_gib=0.01, tensor_parallel_size=2) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, keep
    with as_rank(0, 2), pytest.raises(ValueError, match="pre-sharded folder of float8 "
                                                        "weights.*TOKENMILL_FP8_BLOCKS=dequ"):
        load_model(kept, load_hf_config(kept), torch.float32, cpu, 64, quantization="int8")
    # a rank file whose float8 layer is not (another writer's) is named, not loaded
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{kept}/{rank_file(0)}")
    name = layer + "mlp.experts.2.down_proj.qweight"
    tensors[name] = tensors[name].float()
    save_file(tensors, f"{kept}/{rank_file(0)}")
    with as_rank(0, 2), pytest.raises(ValueError, match=r"layer 'model\.layers\.1\.mlp\."
                                                        r"experts\.2\.down_proj' has float8 "
                                                        "tensors"):
        load_model(kept, load_hf_config(kept), torch.float32, cpu, 64)


# ---- the kernels (Triton's interpreter on the CPU) -------------------------------------

triton_kernels = pytest.importorskip("tokenmill.quantization.triton_kernels")
MODES = [triton_kernels.FP8_NATIVE, triton_kernels.FP8_BYTES]


@pytest.mark.parametrize("mode", MODES)
def test_every_float8_value_read_exactly(mode):
    """All 254 finite e4m3 bytes, the subnormals too, through the weight-only matmul
    against an identity: each comes out as torch's float8 conversion gives it."""
    values = torch.arange(256, dtype=torch.uint8)
    values[values.view(torch.float8_e4m3fn).float().isnan()] = 0
    w = values.view(torch.float8_e4m3fn).reshape(2, 128)
    x = torch.eye(128)
    y = triton_kernels.weight_only_matmul(x.to(DEVICE), w.to(DEVICE),
                                          torch.ones(2, 4, device=DEVICE), None, None, 32,
                                          fp8=mode)
    torch.testing.assert_close(y.T.cpu(), w.float(), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_block_matmul_matches_dequantize_then_matmul(mode, rows, bias):
    torch.manual_seed(1)
    w = torch.randn(200, 256) * 0.05  # 200 rows: a partial block of rows and of channels
    q, scale = fp8_blocks(w, (128, 128))
    kernel = Fp8BlockKernel({"qweight": q, "scale": blocks.row_scales(scale, (128, 128), 200)})
    torch.testing.assert_close(kernel.dequantize(), blocks.dequantize(q, scale, (128, 128)),
                               rtol=0, atol=0)
    x, b = torch.randn(rows, 256), torch.randn(200) if bias else None
    y = triton_kernels.weight_only_matmul(
        x.to(DEVICE), q.to(DEVICE), kernel.scale.to(DEVICE), None,
        None if b is None else b.to(DEVICE), kernel.group, fp8=mode)
    torch.testing.assert_close(y.cpu(), F.linear(x, kernel.dequantize(), b), rtol=1e-4,
                               atol=1e-4)


def test_fp8_block_kernel_takes_triton_for_decodes_only(monkeypatch):
    from tokenmill.layers.linear import Linear
    from tokenmill.quantization import linear_kernels

    monkeypatch.setattr(linear_kernels.QuantizedKernel, "_on_triton_gpu", lambda self, k: True)
    torch.manual_seed(2)
    layer = Linear(64, 40, bias=True).to(DEVICE)
    layer.bias.data.normal_()
    q, scale = fp8_blocks(torch.randn(40, 64) * 0.1, (32, 32))
    kernel = Fp8BlockKernel({"qweight": q.to(DEVICE),
                             "scale": blocks.row_scales(scale, (32, 32), 40).to(DEVICE)})
    assert kernel.triton and kernel.name == "fp8-block-triton"
    calls = []
    monkeypatch.setattr(triton_kernels, "weight_only_matmul",
                        lambda *a, f=triton_kernels.weight_only_matmul: calls.append(
                            a[0].shape[0]) or f(*a))
    for rows in (3, Fp8BlockKernel.TRITON_MAX_ROWS + 1):
        x = torch.randn(rows, 64, device=DEVICE)
        torch.testing.assert_close(kernel.apply(layer, x),
                                   F.linear(x, kernel.dequantize(), layer.bias),
                                   rtol=1e-4, atol=1e-4)
    assert calls == [3]


@pytest.mark.parametrize("mode", MODES)
def test_fp8_block_experts_fused_equal_the_loop(monkeypatch, mode):
    from tokenmill.layers.fused_moe import FusedExperts
    from tokenmill.layers.moe import grouped_experts, softmax_top_k
    from tokenmill.models.llama import MLP

    class Cfg:
        hidden_size, intermediate_size, mlp_bias, hidden_act = 64, 96, False, "silu"

    monkeypatch.setattr(triton_kernels, "fp8_mode", lambda device: mode)
    torch.manual_seed(5)
    mlps = torch.nn.ModuleList(MLP(Cfg()) for _ in range(4)).to(DEVICE)
    for mlp in mlps:
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            n = layer.weight.shape[0]
            q, scale = fp8_blocks(layer.weight.data.normal_(0, 0.2).cpu(), (64, 32))
            layer.use_kernel(Fp8BlockKernel({
                "qweight": q.to(DEVICE),
                "scale": blocks.row_scales(scale, (64, 32), n).to(DEVICE)}))
    x = torch.randn(9, 64, device=DEVICE)
    weights, ids = softmax_top_k(torch.randn(9, 4, device=DEVICE), 2, True)
    ref = grouped_experts(x, weights, ids, mlps)
    assert FusedExperts.servable(mlps)
    fused = FusedExperts(mlps)
    assert fused.w13.quant == 8 and fused.w2.group == 32
    assert mlps[1].down_proj.kernel.qweight.data_ptr() == fused.w2.w[1].data_ptr()
    torch.testing.assert_close(fused(x, weights, ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_block_model_on_gpu_kernels_matches_transformers(tmp_path, tiny_models,
                                                             monkeypatch, mode):
    """DeepSeek-V3 from a block-FP8 checkpoint as a GPU runs it: kept float8 linears on the
    Triton matmul, float8 experts fused, latent attention in the Triton kernel, decode steps
    in graph buckets (eager here), both ways of reading float8."""
    from tokenmill.layers.linear import CpuPackedKernel
    from tokenmill.layers.moe import SparseMoE
    from tokenmill.quantization import linear_kernels

    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "keep")
    path, hf = fp8_checkpoint(tmp_path, tiny_models, "deepseek_v3", KEPT_BLOCK)
    fuse = SparseMoE.fuse_experts
    monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: fuse(self, force=True))
    monkeypatch.setattr(CpuPackedKernel, "supports", staticmethod(lambda layer: False))
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    monkeypatch.setattr(linear_kernels.QuantizedKernel, "_on_triton_gpu", lambda self, k: True)
    monkeypatch.setattr(triton_kernels, "fp8_mode", lambda device: mode)
    llm = LLM(path, kv_cache_memory_gib=0.01, attention_backend="triton", max_num_seqs=4)
    model = llm.engine.core.runner.model
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moe and all(m.fused is not None and m.fused.w13.w.dtype == torch.float8_e4m3fn
                       for m in moe)
    down = model.model.layers[0].mlp.down_proj.kernel
    assert down.name == "fp8-block-triton" and down.fp8_read == mode
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in PROMPTS]
