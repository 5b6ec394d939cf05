"""Model files as untrusted input (`loading/file_checks.py`): the hostile pass's malformed
GGUF, safetensors, config.json and tokenizer.json files are each one `ModelFileError` naming
the file and the field, before anything is allocated; and property-based fuzzing of the same
readers (bytes truncated or overwritten at random) finds no other exception, bounded in time
(hypothesis, a fixed number of examples)."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.loading.file_checks import (
    ModelFileError,
    check_config,
    check_gguf,
    check_json_file,
    check_safetensors,
)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def tiny_gguf(path) -> bytes:
    """A small valid GGUF: a string, an array of strings, a uint32, two float tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("token_embd.weight", np.ones((3, 32), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _header_offsets(raw: bytes) -> dict[str, int]:
    """Byte offsets of the fields a hostile file overwrites, found by walking the tiny file."""
    pos = 24  # magic, version, tensor count (8), kv count (8)
    offsets = {"tensor_count": 8, "kv_count": 16}
    for _ in range(struct.unpack_from("<Q", raw, 16)[0]):
        key_len = struct.unpack_from("<Q", raw, pos)[0]
        key = raw[pos + 8:pos + 8 + key_len]
        pos += 8 + key_len
        kind = struct.unpack_from("<I", raw, pos)[0]
        pos += 4
        if kind == 8:
            offsets["string_length"] = pos
            pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        elif kind == 9:
            offsets["array_length"] = pos + 4
            count = struct.unpack_from("<Q", raw, pos + 4)[0]
            pos += 12
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        else:
            pos += 4
        assert key  # (every key has a name)
    name_len = struct.unpack_from("<Q", raw, pos)[0]
    offsets["tensor_dim"] = pos + 8 + name_len + 4
    return offsets


@pytest.mark.parametrize("field,value,fragment", [
    ("tensor_count", 1 << 60, "tensor count"),
    ("kv_count", 1 << 60, "key-value count"),
    ("array_length", 1 << 60, "claims"),
    ("string_length", (1 << 63) - 1, "runs past the end"),
    ("tensor_dim", (1 << 62) + 5, r"multiply past 2\^62"),
])
def test_hostile_gguf_headers_are_one_error_each(tmp_path, field, value, fragment):
    raw = bytearray(tiny_gguf(tmp_path / "ok.gguf"))
    check_gguf(str(tmp_path / "ok.gguf"))
    struct.pack_into("<Q", raw, _header_offsets(bytes(raw))[field], value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match=fragment) as info:
        check_gguf(str(bad))
    assert str(info.value).startswith("bad.gguf: ")


@pytest.mark.parametrize("keep", [0, 3, 24, 200, -1])
def test_a_truncated_gguf_is_one_error(tmp_path, keep):
    raw = tiny_gguf(tmp_path / "ok.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(raw[:keep] if keep >= 0 else raw[:-8])  # (-1: the tensor data cut short)
    with pytest.raises(ModelFileError, match="cut.gguf: "):
        check_gguf(str(bad))


@pytest.fixture(scope="module")
def llama_gguf(tiny_models, tmp_path_factory) -> bytes:
    """The tiny llama as a GGUF file (the header's metadata a real converter writes)."""
    from tokenmill.convert.gguf_writer import write_gguf

    path, hf = tiny_models("llama")
    out = tmp_path_factory.mktemp("llama") / "tiny.gguf"
    write_gguf(str(out), "llama", hf.state_dict(), hf.config)
    return out.read_bytes()


@given(data=st.data())
@FUZZ
def test_fuzzed_gguf_files_load_or_fail_with_one_error(tmp_path_factory, llama_gguf, data):
    """Bytes of a valid GGUF overwritten (with small and huge values, mostly in the header)
    or cut: the config reader (gguf's reader behind the header check) either reads it or
    raises a ValueError (a ModelFileError, or a config refusal); never another exception."""
    from tokenmill.loading.gguf import _reader, load_gguf_config

    folder = tmp_path_factory.mktemp("g")
    raw = bytearray(llama_gguf)
    header_end = min(len(raw) - 8, 4096)  # (the metadata and tensor infos lie there)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, header_end) | st.integers(0, len(raw) - 8))
        value = data.draw(st.sampled_from([0, 1, 255, 1 << 31, 1 << 40, (1 << 64) - 1])
                          | st.integers(0, (1 << 64) - 1))
        struct.pack_into("<Q", raw, at, value)
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    path = folder / f"f{data.draw(st.integers(0, 1 << 30))}.gguf"
    path.write_bytes(bytes(raw))
    try:
        check_config(load_gguf_config(str(path)), str(path))
    except ValueError:
        pass
    finally:
        _reader.cache_clear()


def tiny_safetensors(path) -> bytes:
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.ones(4, 3), "b": torch.arange(5, dtype=torch.int64)}, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("mutate,fragment", [
    (lambda raw, n: struct.pack("<Q", 1 << 63) + raw[8:], "header length"),
    (lambda raw, n: struct.pack("<Q", len(raw)) + raw[8:], "header length"),
    (lambda raw, n: raw[:8] + raw[8:8 + n].replace(b"[4,3]", b"[9,9]") + raw[8 + n:],
     "needs 324 bytes"),
    (lambda raw, n: raw[:8] + raw[8:8 + n].replace(b'"F32"', b'"X32"') + raw[8 + n:],
     "no known dtype"),
    (lambda raw, n: raw[:-4], "not a range within"),
    (lambda raw, n: raw[:5], "too short"),
])
def test_hostile_safetensors_headers_are_one_error_each(tmp_path, mutate, fragment):
    raw = tiny_safetensors(tmp_path / "ok.safetensors")
    check_safetensors(str(tmp_path / "ok.safetensors"))
    n = struct.unpack_from("<Q", raw)[0]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mutate(raw, n))
    with pytest.raises(ModelFileError, match=fragment):
        check_safetensors(str(bad))


@given(data=st.data())
@FUZZ
def test_fuzzed_safetensors_files_load_or_fail_with_one_error(tmp_path_factory, data):
    """A checked file reads whole with safetensors; anything else is a ModelFileError."""
    from safetensors import safe_open

    folder = tmp_path_factory.mktemp("s")
    raw = bytearray(tiny_safetensors(folder / "ok.safetensors"))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    path = folder / "f.safetensors"
    path.write_bytes(bytes(raw))
    try:
        check_safetensors(str(path))
    except ModelFileError:
        return
    with safe_open(str(path), framework="pt") as f:
        for name in list(f.keys()):  # (safe_open is not iterable)
            f.get_tensor(name)


LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 1024}


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 10**9), ("num_hidden_layers", 10**9), ("vocab_size", 10**12),
    ("max_position_embeddings", 10**12), ("num_attention_heads", 0),
    ("hidden_size", 64.0), ("num_key_value_heads", 3), ("hidden_size", 66),
    ("intermediate_size", -1), ("vocab_size", True), ("num_hidden_layers", "2"),
])
def test_config_sizes_past_the_bounds_are_one_error_each(field, value):
    with pytest.raises(ModelFileError, match=f"config field {field}|config field num_"):
        check_config({**LLAMA, field: value}, "/m/config.json")
    check_config(LLAMA, "/m/config.json")


@given(st.dictionaries(st.sampled_from(sorted(LLAMA) + ["head_dim", "sliding_window",
                                                        "num_experts", "kv_lora_rank"]),
                       st.none() | st.booleans() | st.integers(-2, 1 << 70) | st.floats()
                       | st.text(max_size=5) | st.lists(st.integers(), max_size=2)))
@FUZZ
def test_fuzzed_configs_pass_within_bounds_or_fail_with_one_error(overrides):
    config = {**LLAMA, **overrides}
    try:
        check_config(config, "config.json")
    except ModelFileError:
        return
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert isinstance(config[field], int) and 1 <= config[field] <= 1 << 23


def test_a_tokenizer_json_nested_200000_deep_is_one_error(tiny_models, tmp_path):
    import shutil

    from tokenmill.loading.checkpoint import load_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(tiny_models("llama")[0], folder)
    (folder / "tokenizer.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelFileError, match="tokenizer.json: arrays and objects nested"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").write_bytes(b"x" * 10)
    check_json_file(str(folder / "tokenizer.json"))  # (not JSON: the loader's own error)


_PEAK_OF_ITSELF = """
import atexit, resource, runpy, sys
atexit.register(lambda: sys.stderr.write(
    "PEAK_KB=%d\\n" % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
sys.argv = ["tokenmill", *sys.argv[1:]]
runpy.run_module("tokenmill.entrypoints.cli", run_name="__main__")
"""


def _peak_mib_of(args, cwd) -> tuple[int, str, float]:
    """Runs a tokenmill command; its exit code, output (without the peak line), and its own
    peak RSS in MiB (reported by the process itself as it exits)."""
    proc = subprocess.run([sys.executable, "-c", _PEAK_OF_ITSELF, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout + proc.stderr).splitlines()
    peak = next(int(line[8:]) for line in lines if line.startswith("PEAK_KB=")) / 1024
    return proc.returncode, "\n".join(x for x in lines if not x.startswith("PEAK_KB=")), peak


@pytest.mark.parametrize("field,value", [("hidden_size", 10**9), ("vocab_size", 10**12),
                                         ("num_attention_heads", 0)])
def test_the_commands_print_one_line_and_exit_2_with_memory_bounded(tiny_models, tmp_path,
                                                                   field, value):
    """`tokenmill convert` and `tokenmill generate` on a config past the bounds: one line
    naming the file and field, exit 2, no traceback, peak memory far from the gigabytes the
    config asks for."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_models("llama")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    for args in (["convert", str(folder), str(tmp_path / "o.gguf")],
                 ["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2"]):
        code, out, peak = _peak_mib_of(args, tmp_path)
        assert code == 2, out[-2000:]
        assert "Traceback" not in out, out[-2000:]
        last = out.strip().splitlines()[-1]
        assert last.startswith("error: ") and f"config field {field}" in last, last
        assert peak < 2048, peak
        assert not (tmp_path / "o.gguf").exists()
