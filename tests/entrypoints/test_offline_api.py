"""The `LLM` offline API and the `tokenmill generate` CLI on a tiny model."""

import subprocess
import sys

import pytest

from tokenmill import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.02, max_model_len=256)


def test_text_prompts_in_order_with_vllm_shapes(llm):
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "Paris is", "block after block"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == tok.encode(prompt)
        (c,) = out.outputs
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # Same prompt alone gives the same greedy tokens.
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_per_prompt_params_and_length_mismatch(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                     SamplingParams(max_tokens=4, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Paris is the capital of"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(conv, params, use_tqdm=False)
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    both = llm.chat([conv, conv + [{"role": "assistant", "content": "France"}]], params,
                    use_tqdm=False)
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids and len(both) == 2


def test_chat_with_its_own_template(llm):
    """`chat_template=` renders in place of the tokenizer's: the prompt is the template's
    text, and the output what the same ids give as a plain prompt."""
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Paris is the capital of"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(conv, params, use_tqdm=False, chat_template=template)
    ids = tok.encode("<user>Paris is the capital of<assistant>", add_special_tokens=False)
    assert out.prompt_token_ids == ids
    (plain,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert tok.chat_template != template  # (the tokenizer's own is untouched)


def test_bad_prompts_raise_and_leave_engine_clean(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [3] * 256}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    for ids in ([10**9], [5, -1, 6], [5, 6, 10**9]):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
            llm.generate({"prompt_token_ids": ids}, use_tqdm=False)
    for ids in ([5, 6.0], [5, "6"], [None]):
        with pytest.raises(ValueError, match="must be a list of integers"):
            llm.generate({"prompt_token_ids": ids}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"text": "x"}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=1), use_tqdm=False)[0].finished


def test_invalid_engine_args():
    with pytest.raises(ValueError, match="block_size"):
        LLM("unused", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM("unused", dtype="int3")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")


def test_max_model_len_above_model_limit(tiny_models):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_models("llama")[0], max_model_len=10**6)


def test_cli_generate(tiny_models, llm):
    path = tiny_models("llama")[0]
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "generate", "--model", path,
         "--prompt", "Paris is", "--max-tokens", "6", "--kv-cache-memory", "0.02"],
        capture_output=True, text=True, check=True)
    expected = llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "generate",
                          "--model", "/nonexistent", "--prompt", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr
