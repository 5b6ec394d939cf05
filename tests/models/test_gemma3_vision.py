"""Gemma 3 with its images (SigLIP tower, pooled projector, image rows attending to each
other both ways) against transformers on a tiny random checkpoint: the tower's rows; the
prompt as Gemma3Processor makes it (each image wrapped in "\\n\\n" text, newline runs at the
seams one token as the tokenizer makes them); greedy tokens and prompt logprobs of image
requests batched with text ones through chunked prefill, with a token budget smaller than
an image (the image still goes in one chunk), across preemption and a prefix-cache hit
that ends inside an image, on two tensor-parallel ranks; LLM.chat with image parts."""

import math

import pytest
import torch
from helpers import GEMMA3_IMAGE, data_url, gemma3_greedy, make_gemma3_vl, png
from helpers import random_image as image

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
B = GEMMA3_IMAGE
# (text, images as (seed, width, height)); the second's newlines merge with the wrapping
REQUESTS = [(f"The quick {B} brown fox and {B} jumps", [(1, 40, 50), (2, 64, 32)]),
            (f"Paris is\n{B}\n\nthe capital", [(3, 30, 30)]),
            ("Tokens flow through the mill", [])]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_vl") / "tiny")
    return (path, *make_gemma3_vl(path))


def _prompts(requests):
    return [{"prompt": text, "multi_modal_data": {"image": [image(*i) for i in imgs]}}
            if imgs else text for text, imgs in requests]


def test_tower_rows_equal_transformers(gemma3):
    from tokenmill.loading.checkpoint import load_vision_encoder

    path, model, images, _ = gemma3
    pixels = images(images=[image(1, 40, 50), image(2, 64, 32)],
                    return_tensors="pt")["pixel_values"]
    encoder = load_vision_encoder(path, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        ours = encoder.encode([(p, []) for p in pixels])
        theirs = model.model.get_image_features(pixels).pooler_output
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("budget", [16, 3])
def test_greedy_tokens_equal_transformers(gemma3, budget):
    """16-token steps reach the images over several chunks; 3-token steps are smaller than
    an image's rows, which still go in one chunk (they attend to each other)."""
    path, model, images, tok = gemma3
    expected = [gemma3_greedy(model, images, tok, text, [image(*i) for i in imgs])
                for text, imgs in REQUESTS]
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=budget) as llm:
        outs = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_prompt_logprobs_equal_transformers(gemma3):
    """Every prompt token's logprob after the image rows, which see each other both ways
    (causal image rows would move them), against transformers' forward."""
    path, model, images, tok = gemma3
    text, imgs = REQUESTS[0][0], [image(*i) for i in REQUESTS[0][1]]
    ids, _ = gemma3_greedy(model, images, tok, text, imgs, n=1)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, token_type_ids=(x == model.config.image_token_id).long(),
                       pixel_values=images(images=imgs, return_tensors="pt")["pixel_values"]
                       ).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16) as llm:
        out = llm.generate(_prompts(REQUESTS[:1]), params, use_tqdm=False)[0]
    ours = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ours, expected.tolist()))


def test_offline_chat_takes_image_url_parts(gemma3):
    path, model, images, tok = gemma3
    picture = image(7, 36, 28)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": data_url(png(picture))}},
        {"type": "text", "text": "What is it?"}]}]
    template = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image"},
                                             {"type": "text", "text": "What is it?"}]}]
    text = tok.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    ids, tokens = gemma3_greedy(model, images, tok, text, [picture])
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens


def test_tensor_parallel_ranks_get_the_spans(gemma3):
    """Two tensor-parallel ranks: rank 1 reads the image spans from the step's message."""
    path, model, images, tok = gemma3
    expected = [gemma3_greedy(model, images, tok, text, [image(*i) for i in imgs])[1]
                for text, imgs in REQUESTS]
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16,
             tensor_parallel_size=2) as llm:
        outs = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_prefix_cache_hit_ending_inside_an_image_and_preemption(gemma3):
    """Two prompts with the same image and different text after it: the second's cache hit
    ends inside the image (blocks of 8), and the chunk computing the rest of the image
    attends over its cached rows both ways; another image shares nothing; requests that
    preempt each other recompute their images whole. Tokens equal transformers'."""
    path, model, images, tok = gemma3
    requests = [(f"The quick brown {B}the capital of France", [(3, 30, 30)]),
                (f"The quick brown {B}mills grind", [(3, 30, 30)]),
                (f"The quick brown {B}mills grind", [(4, 30, 30)])]
    expected = [gemma3_greedy(model, images, tok, t, [image(*i) for i in imgs])
                for t, imgs in requests]
    with LLM(path, kv_cache_memory_gib=0.02, block_size=8) as llm:
        outs = [llm.generate(_prompts([r]), GREEDY, use_tqdm=False)[0] for r in requests]
    offset = expected[1][0].index(model.config.image_token_id)
    assert offset < outs[1].num_cached_tokens < offset + model.config.mm_tokens_per_image
    assert outs[2].num_cached_tokens == 0
    assert [o.outputs[0].token_ids for o in outs] == [tokens for _, tokens in expected]
    crowded = [(f"The quick brown {B} fox and {B} jumps", [(s, 40, 50), (s + 1, 64, 32)])
               for s in range(4)]
    with LLM(path, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16) as llm:
        outs = llm.generate(_prompts(crowded), GREEDY, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [
        gemma3_greedy(model, images, tok, t, [image(*i) for i in imgs])[1]
        for t, imgs in crowded]
