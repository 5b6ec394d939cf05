"""Pre-sharded parallel checkpoints (`tokenmill convert --tp-size N [--pp-size P]`): each
rank's file holds only its share (the source's tensors split as the parallel layers split
them) and a rank loads it without the other files; served with the layout they were written
for (tensor, pipeline, expert parallel) they give the original checkpoint's tokens, in float
and quantized at load; a GGUF source shards alike; another layout, a missing rank file or a
foreign tensor is named."""

import os
import shutil

import pytest
import torch
from helpers import hf_greedy
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.parallel_state import as_rank
from tokenmill.entrypoints.cli import main as cli
from tokenmill.loading.checkpoint import load_hf_config, load_model
from tokenmill.loading.sharded import SHARDING, rank_file

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _tokens(path, **engine):
    with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tp2(tiny_models, tmp_path_factory):
    src = tiny_models("llama")[0]
    out = str(tmp_path_factory.mktemp("sharded") / "tp2")
    assert cli(["convert", src, out, "--tp-size", "2"]) == 0
    return src, out


def test_each_rank_file_holds_its_share_only(tp2, tmp_path):
    src, out = tp2
    whole = load_file(os.path.join(src, "model.safetensors"))
    ranks = [load_file(os.path.join(out, rank_file(r))) for r in range(2)]
    layer = "model.layers.1."
    cat = torch.cat
    # row-parallel: input columns split; column-parallel: output rows split; merged layers
    # (q|k|v, gate|up) hold each part's rows of this rank; vocabulary rows split
    assert torch.equal(cat([r[layer + "mlp.down_proj.weight"] for r in ranks], 1),
                       whole[layer + "mlp.down_proj.weight"])
    assert torch.equal(cat([r[layer + "self_attn.o_proj.weight"] for r in ranks], 1),
                       whole[layer + "self_attn.o_proj.weight"])
    gate, up = whole[layer + "mlp.gate_proj.weight"], whole[layer + "mlp.up_proj.weight"]
    half = gate.shape[0] // 2
    for i, r in enumerate(ranks):
        assert torch.equal(r[layer + "mlp.gate_up_proj.weight"],
                           cat([gate[i * half:(i + 1) * half], up[i * half:(i + 1) * half]]))
    assert torch.equal(cat([r["model.embed_tokens.weight"] for r in ranks]),
                       whole["model.embed_tokens.weight"])
    assert torch.equal(ranks[1][layer + "input_layernorm.weight"],
                       whole[layer + "input_layernorm.weight"])  # (replicated)
    # the whole rows' maxima travel with a row-parallel slice (for quantizing at load)
    assert torch.equal(ranks[1][layer + "mlp.down_proj.row_absmax"],
                       whole[layer + "mlp.down_proj.weight"].abs().amax(1))
    source_bytes = os.path.getsize(os.path.join(src, "model.safetensors"))
    for r in range(2):
        assert os.path.getsize(os.path.join(out, rank_file(r))) < 0.6 * source_bytes
    # a rank needs its own file only: rank 0 loads from a folder without rank 1's
    alone = str(tmp_path / "rank0-only")
    shutil.copytree(out, alone, ignore=shutil.ignore_patterns(rank_file(1)))
    with as_rank(0, 2):
        model = load_model(alone, load_hf_config(alone), torch.float32, torch.device("cpu"),
                           64, float_weights=True)
        for name, p in model.named_parameters():
            assert torch.equal(p, ranks[0][name]), name


def test_sharded_folder_serves_the_original_tokens(tp2, tiny_models):
    src, out = tp2
    one = _tokens(src)
    hf = tiny_models("llama")[1]
    assert one[0] == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)
    assert _tokens(out, tensor_parallel_size=2) == one
    # quantized at load: the whole rows' scales, as one rank quantizing the whole checkpoint
    assert _tokens(out, tensor_parallel_size=2, quantization="int8") == \
        _tokens(src, quantization="int8")


def test_pipeline_and_expert_parallel_layouts(tiny_models, tmp_path):
    src = tiny_models("llama")[0]
    pp = str(tmp_path / "pp2")
    assert cli(["convert", src, pp, "--pp-size", "2"]) == 0
    with safe_open(os.path.join(pp, rank_file(1)), "pt") as f:
        names = list(f.keys())  # (the last stage: its layers and the LM head only)
    assert "lm_head.weight" in names and not any(n.startswith("model.layers.0.") for n in names)
    assert _tokens(pp, pipeline_parallel_size=2) == _tokens(src)
    moe = tiny_models("qwen3_moe")[0]
    ep = str(tmp_path / "ep2")
    assert cli(["convert", moe, ep, "--tp-size", "2", "--enable-expert-parallel"]) == 0
    with safe_open(os.path.join(ep, rank_file(1)), "pt") as f:
        names = list(f.keys())
    experts = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
    assert experts and all(int(e) % 2 == 1 for e in experts)  # (whole experts, every other)
    assert _tokens(ep, tensor_parallel_size=2, enable_expert_parallel=True) == _tokens(moe)


def test_gguf_source_shards_alike(tp2, tmp_path):
    from transformers import AutoTokenizer

    from tokenmill.convert.gguf_writer import write_gguf

    src, out = tp2
    gguf = str(tmp_path / "m.gguf")
    write_gguf(gguf, "llama", load_file(os.path.join(src, "model.safetensors")),
               load_hf_config(src), tokenizer=AutoTokenizer.from_pretrained(src))
    from_gguf = str(tmp_path / "tp2")
    assert cli(["convert", gguf, from_gguf, "--tp-size", "2"]) == 0
    for r in range(2):
        theirs, ours = load_file(os.path.join(from_gguf, rank_file(r))), \
            load_file(os.path.join(out, rank_file(r)))
        assert theirs.keys() == ours.keys()
        for name in ours:
            assert torch.equal(theirs[name], ours[name]), name


def test_wrong_layout_missing_file_and_foreign_tensor_are_named(tp2, tmp_path, capsys):
    src, out = tp2
    config = load_hf_config(out)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="sharded for 2 tensor-parallel x 1 pipeline ranks: "
                                         "serve it with --tensor-parallel-size 2"):
        load_model(out, config, torch.float32, cpu, 64)
    broken = str(tmp_path / "broken")
    shutil.copytree(out, broken, ignore=shutil.ignore_patterns(rank_file(1)))
    with as_rank(1, 2), pytest.raises(ValueError, match=r"rank1\.safetensors is missing"):
        load_model(broken, config, torch.float32, cpu, 64)
    tensors = load_file(os.path.join(out, rank_file(0)))
    tensors["model.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, os.path.join(broken, rank_file(0)))
    with as_rank(0, 2), pytest.raises(ValueError, match="'model.layers.9.mlp.down_proj.weight' "
                                                        "matches no parameter"):
        load_model(broken, config, torch.float32, cpu, 64)
    assert os.path.isfile(os.path.join(out, SHARDING))
    assert cli(["convert", src, out, "--tp-size", "2"]) == 2  # (never over a folder)
    assert "exists" in capsys.readouterr().err
    assert cli(["convert", src, str(tmp_path / "one"), "--tp-size", "1"]) == 2
    assert "2 or more ranks" in capsys.readouterr().err
    assert cli(["convert", src, str(tmp_path / "q"), "--tp-size", "2", "--outtype", "q8_0"]) == 2
    assert "--dtype" in capsys.readouterr().err  # (a GGUF type means nothing for shards)
    assert cli(["convert", src, str(tmp_path / "x.gguf"), "--dtype", "bfloat16"]) == 2
    assert "--tp-size" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gemma", "qwen3_next", "mamba2"])
def test_families_with_their_own_layouts_shard_alike(tiny_models, tmp_path, arch):
    """(1 + w) norms kept as the parameters hold them; the state layers' convolutions and
    per-head vectors split by their sections (x | B | C, q | k | v)."""
    src = tiny_models(arch)[0]
    out = str(tmp_path / "tp2")
    assert cli(["convert", src, out, "--tp-size", "2"]) == 0
    assert _tokens(out, tensor_parallel_size=2) == _tokens(src)
