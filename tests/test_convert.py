"""`tokenmill convert`: HF -> GGUF -> tokenmill, transformers and the `gguf` reader, and
GGUF -> HF, on tiny random models: greedy tokens identical to the source model at f32 (tied
and untied embeddings), quantized files loading equal to transformers' reading of the same
file, the tokenizer and chat template carried over, clean errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 2]}, "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "convert", *args],
                          capture_output=True, text=True, timeout=600)


def _tokens(model: str) -> list[list[int]]:
    with LLM(model, kv_cache_memory_gib=0.02) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # (qwen3: tied embeddings, q/k norms)
def test_hf_to_gguf_to_hf_at_f32_keeps_every_token(tiny_models, tmp_path, arch):
    import gguf
    from transformers import AutoTokenizer

    src = tiny_models(arch)[0]
    out = str(tmp_path / "m.gguf")
    done = _convert(src, out, "--outtype", "f32")
    assert done.returncode == 0, done.stderr
    want = _tokens(src)
    assert _tokens(out) == want
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    ours, theirs = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file="m.gguf")
    text = "Paris is the capital of France. <s> tokens!"
    assert theirs.encode(text, add_special_tokens=False) == \
        ours.encode(text, add_special_tokens=False)
    assert theirs.chat_template == ours.chat_template
    back = str(tmp_path / "back")
    done = _convert(out, back)
    assert done.returncode == 0, done.stderr
    assert _tokens(back) == want


def _transformers_greedy(folder: str, name: str) -> list[int]:
    """transformers' greedy tokens after PROMPTS[0] from the GGUF file (dequantized)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                              dtype=torch.float32).eval()
    ids = PROMPTS[0]["prompt_token_ids"]
    return hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                       attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       pad_token_id=1, eos_token_id=None)[0, len(ids):].tolist()


def _tokenmill_greedy(path: str) -> list[int]:
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        return llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_quantized_gguf_equals_transformers_reading_it(tiny_models, tmp_path):
    pytest.importorskip("accelerate")

    src = tiny_models("llama")[0]
    out = str(tmp_path / "q8.gguf")
    assert _convert(src, out, "--outtype", "q8_0").returncode == 0
    assert _tokenmill_greedy(out) == _transformers_greedy(str(tmp_path), "q8.gguf")
    assert os.path.getsize(out) < os.path.getsize(os.path.join(src, "model.safetensors")) / 3


def test_errors(tiny_models, tmp_path):
    src = tiny_models("llama")[0]
    bad = _convert(src, str(tmp_path / "out"))
    assert bad.returncode == 2 and ".gguf" in bad.stderr and "Traceback" not in bad.stderr
    missing = _convert(str(tmp_path / "nope"), str(tmp_path / "x.gguf"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not os.path.exists(tmp_path / "x.gguf")


LLAMA_CPP = os.path.expanduser("~/.cache/tokenmill-peers/llamacpp/bin/python")


@pytest.mark.skipif(not os.path.exists(LLAMA_CPP), reason="no llama-cpp-python beside us")
def test_llama_cpp_reads_the_file_alike(tiny_models, tmp_path):
    """Where the benchmark's llama.cpp (llama-cpp-python) is installed: it loads the
    converted f16 and q8_0 files, tokenizes as tokenmill does and decodes the same greedy
    tokens."""
    src = tiny_models("llama")[0]
    for outtype in ("f16", "q8_0"):
        out = str(tmp_path / f"{outtype}.gguf")
        assert _convert(src, out, "--outtype", outtype).returncode == 0
        script = ("import json, sys\nfrom llama_cpp import Llama\n"
                  "llm = Llama(model_path=sys.argv[1], n_ctx=128, verbose=False)\n"
                  "ids = llm.tokenize(b'The quick brown fox', add_bos=False)\nout = []\n"
                  "for t in llm.generate(ids, temp=0.0, top_k=1):\n"
                  "    out.append(t)\n    if len(out) == 8: break\n"
                  "print(json.dumps([ids, out]))\n")
        done = subprocess.run([LLAMA_CPP, "-c", script, out], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        ids, theirs = json.loads(done.stdout.strip().splitlines()[-1])
        with LLM(out, kv_cache_memory_gib=0.02) as llm:
            assert llm.get_tokenizer().encode("The quick brown fox",
                                              add_special_tokens=False) == ids
            ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert ours.outputs[0].token_ids == theirs


def test_q4_k_output(tiny_models, tmp_path):
    """q4_k: llama.cpp's Q4_K blocks (written by kquants.py; 256-wide rows, so a wider tiny
    model): gguf-py decodes them within 4-bit error, tokenmill serves the file as it is and
    decodes the greedy tokens transformers' reading of it does."""
    pytest.importorskip("accelerate")
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from tests.helpers import make_model
    from tokenmill.convert.kquants import quantize_q4_k

    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    back = dequantize(quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K).reshape(w.shape)
    assert np.sqrt(((back - w) ** 2).mean()) < 0.1 * np.sqrt((w ** 2).mean())
    src = str(tmp_path / "wide")
    make_model(src, "llama", hidden_size=256, intermediate_size=512, head_dim=64)
    out = str(tmp_path / "q4k.gguf")
    done = _convert(src, out, "--outtype", "q4_k")
    assert done.returncode == 0, done.stderr
    reader = gguf.GGUFReader(out)
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert kinds["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert _tokenmill_greedy(out) == _transformers_greedy(str(tmp_path), "q4k.gguf")
