import copy

import pytest
import torch


def make_adapter(hf_model, path: str, seed: int, **lora_args):
    """A random PEFT adapter on a copy of `hf_model`, saved to `path`; returns the PEFT model
    (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    args = {"r": 8, "lora_alpha": 16, "init_lora_weights": False, **lora_args}
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**args)).eval()
    with torch.no_grad():  # (peft's random B is small; scaled so the adapter changes tokens)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(path)
    return peft_model


@pytest.fixture(scope="session")
def adapters(tiny_models, tmp_path_factory):
    """(arch, key) -> (adapter folder, PEFT model), built once per session."""
    root = tmp_path_factory.mktemp("adapters")
    cache = {}

    def get(arch: str, key: str, seed: int = 0, **lora_args):
        if (arch, key) not in cache:
            path = str(root / f"{arch}-{key}")
            cache[arch, key] = (path, make_adapter(tiny_models(arch)[1], path, seed,
                                                   **lora_args))
        return cache[arch, key]

    return get
