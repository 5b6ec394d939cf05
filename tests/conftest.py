import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# GPU kernels (Triton) run in Triton's interpreter on a machine without a GPU; set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (path, HF model) for every supported architecture, built once per session."""
    from helpers import make_model

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = str(root / arch)
            cache[arch] = (path, make_model(path, arch))
        return cache[arch]

    return get
