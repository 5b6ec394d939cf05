"""Block-scaled FP8 checkpoints (DeepSeek-V3 / R1's release format): each float8 weight
times its block's `weight_scale_inv` factor, on one rank (whole tensors) and two (each
rank's rows or columns, their blocks' factors cut to match)."""

import copy
import json
import shutil

import torch
from helpers import hf_greedy
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
BLOCK = (32, 48)  # rows, columns: the tiny layers hold several, some partial


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    scale = torch.empty(rows, columns)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(columns):
            part = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (
                part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_block_fp8_checkpoint_loads_as_its_float_weights(tmp_path, tiny_models):
    src, hf = tiny_models("qwen2")
    out = tmp_path / "fp8"
    out.mkdir()
    state, rounded = {}, {}
    for name, tensor in hf.state_dict().items():
        if name.endswith("proj.weight"):
            q, scale = fp8_blocks(tensor)
            state[name], state[name + "_scale_inv"] = q, scale
            rows = torch.arange(tensor.shape[0]) // BLOCK[0]
            columns = torch.arange(tensor.shape[1]) // BLOCK[1]
            rounded[name] = q.float() * scale[rows][:, columns]
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"))
    with open(f"{src}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", out / name)
    hf = copy.deepcopy(hf)  # (the session's tiny model stays as it is)
    hf.load_state_dict({**hf.state_dict(), **rounded})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [hf_greedy(hf, p, 10) for p in PROMPTS]
    for tp in (1, 2):
        with LLM(str(out), kv_cache_memory_gib=0.01, tensor_parallel_size=tp) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, tp
