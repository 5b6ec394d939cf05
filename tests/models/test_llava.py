"""LLaVA-1.5 (CLIP tower, MLP projector, a llama) against transformers on a tiny random
checkpoint: greedy tokens of image requests (several images of different sizes, one image,
none) batched together through chunked prefill, the prompt's placeholders as its processor
expands them; the image's rows kept across preemption; prefix-cache hits only for the same
image; and the images refused, each naming why. LLaVA-NeXT's tiles and LLaVA-OneVision's
(SigLIP tower, tiles shrunk to "anyres_max_N", several images a request untiled) too."""


import pytest
import torch
from helpers import data_url, make_llava, make_llava_onevision, make_model, onevision_greedy, png
from helpers import random_image as image
from PIL import Image

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava") / "tiny")
    model, processor = make_llava(path)
    return path, model, processor


def reference(model, processor, prompt: str, images: list) -> tuple[list[int], list[int]]:
    """(the prompt's ids as the processor expands them, transformers' greedy tokens)."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


REQUESTS = [("The quick <image> brown fox and <image> jumps", [(1, 40, 50), (2, 64, 32)]),
            ("Paris is <image> the capital", [(3, 30, 30)]),
            ("Tokens flow through the mill", [])]


def _prompts(requests):
    return [{"prompt": text, "multi_modal_data": {"image": [image(*i) for i in imgs]}}
            if imgs else text for text, imgs in requests]


def test_greedy_tokens_equal_transformers(llava):
    path, model, processor = llava
    expected = [reference(model, processor, text, [image(*i) for i in imgs])
                for text, imgs in REQUESTS]
    # 16-token steps: prompts reach their images over several chunks
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16) as llm:
        outs = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
        assert llm.engine.core.runner.images.rows == {}  # (dropped as requests finished)
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_rows_survive_preemption_and_the_prefix_cache_keys_on_the_image(llava):
    path, model, processor = llava
    text = "The quick <image> brown fox and <image> jumps"
    with LLM(path, num_kv_blocks=10, block_size=16, max_num_batched_tokens=16) as llm:
        # four two-image requests in 10 blocks: they preempt each other
        requests = [(text, [(s, 40, 50), (s + 1, 64, 32)]) for s in range(4)]
        outs = llm.generate(_prompts(requests), GREEDY, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
        for out, (t, imgs) in zip(outs, requests):
            assert out.outputs[0].token_ids == reference(
                model, processor, t, [image(*i) for i in imgs])[1]
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        first, again, other = (llm.generate(_prompts(r), GREEDY, use_tqdm=False)[0]
                               for r in (requests[:1], requests[:1],
                                         [(text, [(9, 40, 50), (10, 64, 32)])]))
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == \
        outs[0].outputs[0].token_ids
    # the same images: every full block but the last token's; other images: nothing
    assert again.num_cached_tokens == 48 and again.outputs == first.outputs
    assert other.num_cached_tokens == 0


def test_bad_images_are_refused_by_name(llava, tmp_path):
    path = llava[0]
    bomb = png(Image.new("1", (8000, 8000)))  # 64M pixels in a few KB
    good = png(image(1, 20, 20))
    cases = [(bomb, "too many pixels|at most 40,000,000"), (good[:len(good) // 2], "truncated"),
             (b"GIF89a not really", "truncated|not a PNG"), (b"%PDF-1.4", "not a PNG")]
    with LLM(path, kv_cache_memory_gib=0.02, limit_mm_per_prompt={"image": 2}) as llm:
        for data, why in cases:
            with pytest.raises(ValueError, match=why):
                llm.generate([{"prompt": "a <image>", "multi_modal_data": {"image": data}}],
                             GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="at most 2 images"):
            llm.generate([{"prompt": "<image>" * 3, "multi_modal_data": {
                "image": [good] * 3}}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="places 1 images but the request holds 2"):
            llm.generate([{"prompt": "a <image>", "multi_modal_data": {"image": [good] * 2}}],
                         GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="image tokens without an image"):
            llm.generate(["a <image> b"], GREEDY, use_tqdm=False)
        # the engine still serves
        assert len(llm.generate([{"prompt": "a <image>", "multi_modal_data": {
            "image": good}}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    text_model = str(tmp_path / "text")
    make_model(text_model, "llama")
    with LLM(text_model, kv_cache_memory_gib=0.02) as llm, pytest.raises(
            ValueError, match="takes no images"):
        llm.generate([{"prompt": "a", "multi_modal_data": {"image": good}}], GREEDY,
                     use_tqdm=False)


def test_offline_chat_takes_image_url_parts(llava):

    path, model, processor = llava
    picture = image(7, 36, 28)
    url = data_url(png(picture))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    template = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image"}]}]
    text = processor.tokenizer.apply_chat_template(template, tokenize=False,
                                                   add_generation_prompt=True)
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    ids, tokens = reference(model, processor, text, [picture])
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens


def test_tensor_parallel_ranks_read_rank_0s_image_rows(llava):
    """Two tensor-parallel ranks: rank 0 encodes the images and broadcasts their rows; the
    tokens equal transformers' as on one rank."""
    path, model, processor = llava
    expected = [reference(model, processor, text, [image(*i) for i in imgs])[1]
                for text, imgs in REQUESTS]
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16,
             tensor_parallel_size=2) as llm:
        outs = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_the_encoder_budget_spreads_images_over_steps(llava):
    """50 image rows a step (two tiny images of 25): a prompt of four images is encoded two
    images at a time, its chunk stopping before the third; the tokens do not change."""
    path, model, processor = llava
    text = "a <image> b <image> c <image> d <image> e"
    imgs = [image(20 + k, 30 + k, 30) for k in range(4)]
    expected = reference(model, processor, text, imgs)[1]
    for budget, passes in ((50, [2, 2]), (None, [4])):
        with LLM(path, kv_cache_memory_gib=0.02, max_num_encoder_input_tokens=budget) as llm:
            vision = llm.engine.core.runner.images.vision
            batches, forward = [], vision.forward
            vision.forward = lambda pixels, b=batches, f=forward: b.append(len(pixels)) or f(pixels)
            out = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}}], GREEDY,
                               use_tqdm=False)[0]
        assert batches == passes and out.outputs[0].token_ids == expected


def test_one_encoder_pass_takes_every_request_s_images(llava):
    """Three requests whose images a step reaches together: one pass through the tower
    (of all their images), each request given its own rows."""
    path, model, processor = llava
    requests = [(f"a <image> {w}", [(30 + k, 30 + k, 30)]) for k, w in
                enumerate(("one", "two", "three"))]
    expected = [reference(model, processor, t, [image(*i) for i in imgs])[1]
                for t, imgs in requests]
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        vision = llm.engine.core.runner.images.vision
        batches, forward = [], vision.forward
        vision.forward = lambda pixels, b=batches, f=forward: b.append(len(pixels)) or f(pixels)
        outs = llm.generate(_prompts(requests), GREEDY, use_tqdm=False)
    assert batches == [3] and [o.outputs[0].token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava_next") / "tiny")
    model, processor = make_llava(path, tiled=True)
    return path, model, processor


def test_llava_next_tiles_equal_transformers(llava_next):
    """LLaVA-NeXT: each image cut to its best grid of tiles (wide, tall, square), the
    grid's padding rows cut off and newline rows added as transformers packs them; the
    prompt's placeholders as LlavaNextProcessor counts them."""
    path, model, processor = llava_next
    requests = REQUESTS + [("wide <image> one", [(5, 90, 20)]),
                           ("tall <image> one", [(6, 16, 70)])]
    expected = [reference(model, processor, text, [image(*i) for i in imgs])
                for text, imgs in requests]
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16) as llm:
        outs = llm.generate(_prompts(requests), GREEDY, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_quantized_and_speculative_text_parts_take_images(llava):
    """The language model int8-quantized, or speculating with n-grams: image requests run
    as text ones do (n-gram drafts verified greedily: the same tokens as without)."""
    path, model, processor = llava
    expected = [reference(model, processor, text, [image(*i) for i in imgs])[1]
                for text, imgs in REQUESTS]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with LLM(path, kv_cache_memory_gib=0.02, speculative_config=spec) as llm:
        drafted = [o.outputs[0].token_ids for o in llm.generate(_prompts(REQUESTS), GREEDY,
                                                                use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.02, quantization="int8") as llm:
        quantized = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    assert drafted == expected
    assert all(len(o.outputs[0].token_ids) == 8 for o in quantized)


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("onevision") / "tiny")
    return (path, *make_llava_onevision(path))


def test_llava_onevision_equals_transformers(onevision):
    """LLaVA-OneVision: an image alone tiled (wide, tall; a large one's grid rows shrunk to
    one tile's worth, "anyres_max_1"), the images of a request holding several each its
    whole-image tile padded square and a newline row; the prompt's placeholders as
    LlavaOnevisionProcessor counts them; chunked prefill, text requests beside."""
    path, model, images, tok = onevision
    requests = [("The quick <image> brown fox and <image> jumps", [(1, 40, 50), (2, 64, 32)]),
                ("Paris is <image> the capital", [(3, 30, 30)]),
                ("wide <image> one", [(5, 90, 20)]), ("tall <image> one", [(6, 16, 70)]),
                ("large <image> one", [(7, 200, 180)]), ("Tokens flow through the mill", [])]
    expected = [onevision_greedy(model, images, tok, text, [image(*i) for i in imgs])
                for text, imgs in requests]
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16) as llm:
        outs = llm.generate(_prompts(requests), GREEDY, use_tqdm=False)
        multimodal = llm.engine.multimodal
    assert multimodal.rows(180, 200) < multimodal.tiles(180, 200) * multimodal.tokens_per_image
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


@pytest.mark.parametrize("family", ["llava_next", "onevision"])
def test_tiled_families_share_prefixes_of_the_same_image(family, request):
    """A repeated tiled image reuses its prompt's blocks and answers the same; another image
    shares none."""
    path = request.getfixturevalue(family)[0]
    text = "a <image> b"
    with LLM(path, kv_cache_memory_gib=0.02, block_size=8) as llm:
        first, again, other = (llm.generate(_prompts([(text, [img])]), GREEDY,
                                            use_tqdm=False)[0]
                               for img in ((11, 90, 20), (11, 90, 20), (12, 90, 20)))
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    full = (len(first.prompt_token_ids) - 1) // 8 * 8
    assert again.num_cached_tokens == full > 0 and again.outputs == first.outputs
