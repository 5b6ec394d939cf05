"""PEFT adapters as TensorRT-LLM's adapter tensors, the obvious way (the tests' reference
converter)."""


TRTLLM_IDS = {"self_attn.q_proj": 1, "self_attn.k_proj": 2, "self_attn.v_proj": 3,
              "self_attn.o_proj": 4, "mlp.gate_proj": 5, "mlp.down_proj": 6, "mlp.up_proj": 7}


def trtllm_tensors(adapter_path: str, fuse_qkv_layers=()):
    """A PEFT adapter as TensorRT-LLM's (lora_weights [rows, L], lora_config [rows, 3]), as
    its hf_lora_convert.py writes them: A flattened, then B times the scale, rows padded with
    zeros. In `fuse_qkv_layers` q, k and v become one attn_qkv module (id 0) of rank 3r: the
    three A's stacked, the three B's block-diagonal."""
    import json
    import os
    import re

    import numpy as np
    import torch
    from safetensors.torch import load_file

    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    pairs = {}
    for key, value in load_file(os.path.join(adapter_path,
                                             "adapter_model.safetensors")).items():
        m = re.match(r".*layers\.(\d+)\.(self_attn\.\w+|mlp\.\w+)\.lora_([AB])\.weight", key)
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value.float()
    rows, config_rows = [], []
    for layer in fuse_qkv_layers:
        parts = [pairs.pop((layer, f"self_attn.{p}_proj")) for p in "qkv"]
        a = torch.cat([p["A"] for p in parts])
        b = torch.block_diag(*[p["B"] * scale for p in parts])
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        config_rows.append([0, layer, a.shape[0]])
    for (layer, module), p in sorted(pairs.items()):
        rows.append(torch.cat([p["A"].flatten(), (p["B"] * scale).flatten()]))
        config_rows.append([TRTLLM_IDS[module], layer, p["A"].shape[0]])
    width = max(len(r) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    return weights.numpy(), np.array(config_rows, dtype=np.int32)
