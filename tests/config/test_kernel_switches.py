"""Kernel switches are resolved once, when the engine's configuration is built, and carried:
the environment changed afterwards reaches no loader, kernel or step path."""

import dataclasses

import pytest

from tokenmill import LLM, csrc
from tokenmill.config import kernels
from tokenmill.config.engine import EngineConfig
from tokenmill.config.kernels import KernelConfig


def test_the_configuration_reads_the_switches_once(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_INT_DOT", "0")
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "keep")
    config = EngineConfig(model="unused")
    monkeypatch.delenv("TOKENMILL_CPU_INT_DOT")
    monkeypatch.delenv("TOKENMILL_FP8_BLOCKS")
    assert not config.kernels.cpu.int_dot and config.kernels.gpu.fp8_blocks == "keep"
    assert dataclasses.replace(config, seed=1).kernels == config.kernels  # (draft runners)
    monkeypatch.setenv("TOKENMILL_FP8_BLOCKS", "sometimes")  # a bad value names its variable
    with pytest.raises(ValueError, match="TOKENMILL_FP8_BLOCKS must be auto, keep or"):
        EngineConfig(model="unused")


def test_switches_in_force_while_an_engine_starts_then_the_ones_before():
    outer = KernelConfig.from_env({})
    inner = dataclasses.replace(outer, cpu=dataclasses.replace(outer.cpu, int_dot=False))
    assert kernels.current() == KernelConfig.from_env()  # (none in force: the environment)
    with kernels.using(outer):
        with kernels.using(inner):
            assert kernels.current() is inner
        assert kernels.current() is outer
    assert kernels.current() == KernelConfig.from_env()


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
def test_an_engine_takes_its_configurations_switches_not_the_environments(tiny_models,
                                                                          monkeypatch):
    path, _ = tiny_models("llama")
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    off = KernelConfig.from_env()
    monkeypatch.delenv("TOKENMILL_CPU_DECODE_STEP")
    with LLM(path, kv_cache_memory_gib=0.01, kernels=off) as llm:
        assert llm.engine.core.runner.decode_step is None
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")
    on = dataclasses.replace(off, cpu=dataclasses.replace(off.cpu, decode_step=True))
    with LLM(path, kv_cache_memory_gib=0.01, kernels=on) as llm:
        assert llm.engine.core.runner.decode_step is not None


@pytest.mark.parametrize("given", [None, "0"])
def test_tokenmill_asks_torch_for_huge_pages_unless_told_not_to(given):
    """Importing tokenmill before torch sets THP_MEM_ALLOC_ENABLE=1 where it is unset, so
    torch's CPU allocator advises huge pages for large buffers; a value given stays."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    code = ("import tokenmill, os, torch; x = torch.ones(16 << 20, dtype=torch.int8); "
            "print(os.environ['THP_MEM_ALLOC_ENABLE'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.split()[-1] == (given or "1")
