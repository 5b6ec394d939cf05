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


SPM_TEXTS = ["Hello world", "Paris is the capital of France.\nNew line", "émigré 🙂 naïve",
             "tabs\tand  double  spaces", "The lazy dog</s>"]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny llama with a SentencePiece-style BPE tokenizer, converted to an f32 GGUF."""
    from tests.helpers import make_model, make_spm_tokenizer

    root = tmp_path_factory.mktemp("spm")
    src = str(root / "spm")
    make_model(src, "llama")
    make_spm_tokenizer(src)
    done = _convert(src, str(root / "spm.gguf"), "--outtype", "f32")
    assert done.returncode == 0, done.stderr
    return src, str(root / "spm.gguf")


def test_sentencepiece_tokenizer_to_gguf(spm_model):
    """A SentencePiece BPE goes in as llama.cpp's `llama` vocabulary: byte tokens, the unknown
    and control tokens typed, each merged token scored by its merge's rank (SentencePiece's
    merge order), BOS added as the source adds it; transformers' reading of the file and
    tokenmill serving it encode every text as the source does, and the f32 file decodes the
    source's greedy tokens."""
    import gguf
    from transformers import AutoTokenizer

    src, out = spm_model
    source = AutoTokenizer.from_pretrained(src)
    fields = gguf.GGUFReader(out).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    kinds = {tokens[i]: gguf.TokenType(types[i]) for i in range(len(tokens))}
    assert kinds["<0x41>"] == gguf.TokenType.BYTE and kinds["<unk>"] == gguf.TokenType.UNKNOWN
    assert kinds["<s>"] == kinds["</s>"] == gguf.TokenType.CONTROL
    merged = [source.convert_tokens_to_ids(m.replace(" ", "")) for m in
              fields["tokenizer.ggml.merges"].contents()[:20]]
    assert all(scores[a] > scores[b] for a, b in zip(merged, merged[1:]))
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(out),
                                           gguf_file=os.path.basename(out))
    with LLM(out, kv_cache_memory_gib=0.02) as llm:
        served = llm.get_tokenizer()
        for text in SPM_TEXTS:
            assert theirs.encode(text) == served.encode(text) == source.encode(text), text
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == _tokens(src)


@pytest.mark.skipif(not os.path.exists(os.path.expanduser(
    "~/.cache/tokenmill-peers/llamacpp/bin/python")), reason="no llama-cpp-python beside us")
def test_llama_cpp_tokenizes_a_sentencepiece_file_alike(spm_model):
    """Where llama.cpp (llama-cpp-python) is installed: it tokenizes every text with the
    converted SentencePiece vocabulary as the source tokenizer does (BOS included)."""
    from transformers import AutoTokenizer

    src, out = spm_model
    script = ("import json, sys\nfrom llama_cpp import Llama\n"
              "llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
              "print(json.dumps([llm.tokenize(t.encode(), add_bos=True, special=True) "
              "for t in json.loads(sys.argv[2])]))")
    done = subprocess.run([os.path.expanduser("~/.cache/tokenmill-peers/llamacpp/bin/python"),
                           "-c", script, out, json.dumps(SPM_TEXTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    source = AutoTokenizer.from_pretrained(src)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == \
        [source.encode(t) for t in SPM_TEXTS]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "qwen2",
                                  "mistral", "gemma2", "gemma3", "phi3", "llama3", "gemma",
                                  "phi", "olmo2", "granite", "granitemoe", "granitemoeshared",
                                  "glm4", "glm4_moe", "gpt_oss", "llama4_gguf", "mamba2",
                                  "qwen3_next"])
def test_round_trip_through_gguf(tiny_models, tmp_path, arch):
    """HF -> GGUF f32 -> HF for every architecture the converter writes: transformers' logits
    of the result equal the source's over a prompt past Llama-3 scaling's original context,
    and tokenmill decodes the same greedy tokens from all three. What each needs: MoE
    checkpoints as the hub ships them (one tensor per expert) stacked into llama.cpp's one
    tensor per layer and kind and split again (DeepSeek's MLA `kv_b` in two halves, its
    `shared_experts` name, the `deepseek2` file's tokenizer read from its metadata); Mistral
    and Mixtral written as llama.cpp's `llama` (Q/K rows permuted; Mixtral's experts read
    back as a Mixtral); Phi-3's rope settings complete;
    Llama 3.1's scaling parameters recovered from the file's `rope_freqs`; Granite-MoE's
    stacked experts split for llama.cpp and stacked again; Phi-2's and GLM's rotary
    dimensions kept."""
    from transformers import AutoModelForCausalLM

    src, hf = tiny_models(arch)
    out, back = str(tmp_path / "m.gguf"), str(tmp_path / "back")
    done = _convert(src, out, "--outtype", "f32")
    assert done.returncode == 0, done.stderr
    done = _convert(out, back)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    again = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 120))])
    # (Qwen3-Next: llama.cpp stores -exp(A_log) and 1 + w norms, each way a float32 rounding)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0,
                                   atol=1e-4 if arch == "qwen3_next" else 1e-5)
    assert _tokens(out) == _tokens(back) == _tokens(src)


def test_llama3_rope_factors_are_transformers():
    """The `rope_freqs` written for Llama 3.1 scaling (rope_theta 500000, as the real models)
    equal transformers' own ratio of unscaled to scaled frequencies, and the parameters are
    found again from them."""
    import numpy as np
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.convert.gguf_keys import llama3_rope_factors, llama3_rope_from_factors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    config = tf.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                            max_position_embeddings=131072, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    ours = llama3_rope_factors(config, rope)
    np.testing.assert_allclose(ours, (plain / scaled).numpy(), rtol=1e-5)
    assert llama3_rope_from_factors(config, {"rope_theta": 500000.0,
                                             "freq_factors": list(ours)}) == rope


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
    converted f16 and q8_0 files (and a Mixtral's, a Mamba-2's and a Qwen3-Next's),
    tokenizes as tokenmill does and decodes the same greedy tokens."""
    for arch, outtype in (("llama", "f16"), ("llama", "q8_0"), ("mixtral", "f16"),
                          ("mamba2", "f16"), ("qwen3_next", "f32")):
        src = tiny_models(arch)[0]
        out = str(tmp_path / f"{arch}-{outtype}.gguf")
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


# (bounds ~1.15x the relative RMS errors of llama.cpp's own pure-type quantizer measured on
# random weights: 0.296, 0.151, 0.071, 0.036, 0.018; ours 0.328, 0.155, 0.078, 0.038, 0.019)
@pytest.mark.parametrize("kind,bound", [("Q2_K", 0.35), ("Q3_K", 0.17), ("Q4_K", 0.085),
                                        ("Q5_K", 0.042), ("Q6_K", 0.021)])
def test_k_quant_blocks_decode_within_their_bits(kind, bound):
    """kquants.py's blocks, read back by gguf-py's dequantizer (llama.cpp's layout): the
    error of their bit width on Gaussian rows, zero rows exact, a constant block and a
    single outlier of either sign kept to float16 precision."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from tokenmill.convert.kquants import BLOCK_BYTES, QUANTIZERS

    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    w[3] = 0.0
    w[4, :256] = 5.0
    w[5, 7], w[6, 300] = 40.0, -40.0
    blocks = QUANTIZERS[kind](w)
    assert blocks.shape == (16, 2 * BLOCK_BYTES[kind])
    back = dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).reshape(w.shape)
    gauss = [r for r in range(16) if r not in (3, 4, 5, 6)]
    rel = np.sqrt(((back[gauss] - w[gauss]) ** 2).mean() / (w[gauss] ** 2).mean())
    assert rel < bound
    assert not back[3].any()
    assert np.abs(back[4, :256] - 5.0).max() < 0.01
    assert abs(back[5, 7] - 40.0) < 0.1 and abs(back[6, 300] + 40.0) < 0.1


WIDE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64, "num_hidden_layers": 8}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny llama whose rows are whole 256-value K-quant blocks but the down projection's
    (384 inputs: llama.cpp's fallback types), with 8 layers for the mixes' layer choice."""
    from tests.helpers import make_model

    src = str(tmp_path_factory.mktemp("wide") / "wide")
    make_model(src, "llama", **WIDE)
    return src


@pytest.mark.parametrize("outtype", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m",
                                     "q5_k_m"])
def test_k_quant_outputs(wide_model, tmp_path, outtype):
    """--outtype q2_k .. q6_k, q4_k_m, q5_k_m: every 2-D weight in the type (or the mix's), rows of
    no whole block in llama.cpp's fallback type; tokenmill serves the file and decodes the
    greedy tokens transformers' reading of it does."""
    pytest.importorskip("accelerate")
    import gguf

    from tokenmill.convert.mixes import FALLBACK, MIXES, OUTTYPES

    T = gguf.GGMLQuantizationType
    out = str(tmp_path / f"{outtype}.gguf")
    done = _convert(wide_model, out, "--outtype", outtype)
    assert done.returncode == 0, done.stderr
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    base = OUTTYPES[outtype]
    assert kinds["blk.1.attn_q.weight"] == kinds["blk.2.ffn_up.weight"] == base
    assert kinds["blk.0.attn_norm.weight"] == T.F32
    downs = {kinds[f"blk.{i}.ffn_down.weight"] for i in range(8)}  # (384-wide rows)
    if outtype not in MIXES:
        assert downs == {FALLBACK[base]}
    else:  # (the LM head and some layers' value / down projections in Q6_K)
        assert kinds["output.weight"] == T.Q6_K
        assert {kinds[f"blk.{i}.attn_v.weight"] for i in range(8)} == {T.Q6_K, base}
        assert downs == {FALLBACK[T.Q6_K], FALLBACK[base]}
    assert _tokenmill_greedy(out) == _transformers_greedy(str(tmp_path), f"{outtype}.gguf")


@pytest.mark.skipif(not os.path.exists(LLAMA_CPP), reason="no llama-cpp-python beside us")
def test_k_m_mixes_are_llama_cpps(wide_model, tmp_path):
    """Where llama.cpp (llama-cpp-python) is installed: its llama-quantize of our f16 file to
    Q4_K_M / Q5_K_M gives every tensor the type our --outtype q4_k_m / q5_k_m gives it."""
    import gguf

    def kinds(path):
        return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}

    f16 = str(tmp_path / "f16.gguf")
    assert _convert(wide_model, f16, "--outtype", "f16").returncode == 0
    for mix in ("q4_k_m", "q5_k_m"):
        ours, theirs = str(tmp_path / f"ours-{mix}.gguf"), str(tmp_path / f"theirs-{mix}.gguf")
        assert _convert(wide_model, ours, "--outtype", mix).returncode == 0
        script = ("import sys, llama_cpp as l\np = l.llama_model_quantize_default_params()\n"
                  f"p.ftype = l.LLAMA_FTYPE_MOSTLY_{mix.upper()}\n"
                  "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
                  "p))")
        done = subprocess.run([LLAMA_CPP, "-c", script, f16, theirs], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert kinds(ours) == kinds(theirs)


def test_convert_never_runs_a_checkpoints_code(tmp_path):
    """A folder whose config.json maps to its own Python code (`auto_map`): transformers asks
    on the terminal whether to run it and runs it on "y". convert refuses the folder by name
    instead, whatever is typed, and the code never runs."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "evil"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil_lm", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}))
    (folder / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_lm'\n")
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "convert",
                           str(folder), str(tmp_path / "out.gguf")], input="y\ny\ny\n",
                          capture_output=True, text=True, timeout=300)
    assert not marker.exists()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs its own Python code" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_gemma3_in_todays_hub_layout_converts(tiny_models, tmp_path):
    """Recent Gemma 3 checkpoints state their local/global layout as `layer_types` (and
    `_sliding_window_pattern`), with no `sliding_window_pattern`: convert read that one
    attribute and failed (AttributeError). The file it writes now gives the source's tokens."""
    import json
    import shutil

    src, _ = tiny_models("gemma3")
    hub = tmp_path / "gemma3-hub"
    shutil.copytree(src, hub)
    config = json.loads((hub / "config.json").read_text())
    period = config.pop("sliding_window_pattern", None) or config["_sliding_window_pattern"]
    config["_sliding_window_pattern"] = period
    config["layer_types"] = ["sliding_attention" if (i + 1) % period else "full_attention"
                             for i in range(config["num_hidden_layers"])]
    (hub / "config.json").write_text(json.dumps(config))
    out = str(tmp_path / "m.gguf")
    done = _convert(str(hub), out, "--outtype", "f32")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _tokens(out) == _tokens(src)


def test_gemma3_window_pattern_as_a_period_or_per_layer():
    import types

    from tokenmill.convert.gguf_keys import _window_pattern

    local, full = "sliding_attention", "full_attention"
    periodic = types.SimpleNamespace(layer_types=[local, full, local, full],
                                     _sliding_window_pattern=2)
    assert _window_pattern(periodic) == 2
    irregular = types.SimpleNamespace(layer_types=[local, local, full, full])
    assert _window_pattern(irregular) == [True, True, False, False]
    assert _window_pattern(types.SimpleNamespace(sliding_window_pattern=6)) == 6
