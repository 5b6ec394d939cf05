"""Qwen2-VL and Qwen2.5-VL (dynamic resolution, window attention, M-RoPE) against
transformers on tiny random checkpoints: the tower's rows of several images of different
sizes in one pass; the M-RoPE positions of any range of a prompt as get_rope_index lays
them out; greedy tokens of image requests (several images, one, none) batched together
through chunked prefill, across preemption, with the prefix cache keyed on the image, on
two tensor-parallel ranks; and images too large for the context refused before they are
processed."""

import numpy as np
import pytest
import torch
from helpers import make_qwen_vl, qwen_vl_expand, qwen_vl_greedy
from helpers import random_image as image

from tokenmill import LLM, SamplingParams
from tokenmill.mm_inputs import MultiModalInput, rope_positions
from tokenmill.worker import step_paths

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# (text, images as (seed, width, height)): wide, small, square, none
REQUESTS = [(f"The quick {IMAGE} brown fox and {IMAGE} jumps", [(1, 90, 50), (2, 64, 40)]),
            (f"Paris is {IMAGE} the capital", [(3, 30, 30)]),
            (f"wide {IMAGE} one", [(4, 200, 120)]),
            ("Tokens flow through the mill", [])]


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen_vl(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen_vl") / "tiny")
    return (path, *make_qwen_vl(path, request.param))


def _prompts(requests):
    return [{"prompt": text, "multi_modal_data": {"image": [image(*i) for i in imgs]}}
            if imgs else text for text, imgs in requests]


def test_tower_rows_equal_transformers(qwen_vl):
    """Four images of different sizes through the tower in one pass (Qwen2.5-VL: grids of
    one to several windows), each one's rows against transformers' visual model."""
    from tokenmill.loading.checkpoint import load_vision_encoder

    path, model, images, _ = qwen_vl
    imgs = [image(1, 90, 50), image(2, 64, 40), image(3, 30, 30), image(4, 200, 120)]
    out = images(images=imgs, return_tensors="pt")
    encoder = load_vision_encoder(path, torch.float32, torch.device("cpu"))
    grids = out["image_grid_thw"]
    sizes = (grids.prod(-1)).tolist()
    pixels = out["pixel_values"].split(sizes)
    with torch.no_grad():
        ours = encoder.encode([(p, g.tolist()) for p, g in zip(pixels, grids)])
        theirs = model.model.get_image_features(out["pixel_values"], grids).pooler_output
    assert len(ours) == 4 and max(sizes) > 16  # (one grid spans several windows)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_rope_positions_equal_get_rope_index(qwen_vl):
    """Any range of a two-image prompt (chunked prefill starts anywhere) gets the positions
    transformers' get_rope_index gives those tokens, and the tokens generated after it
    continue from its rope delta."""
    _, model, images, tok = qwen_vl
    text, imgs = REQUESTS[0][0], [image(*i) for i in REQUESTS[0][1]]
    ids, kwargs = qwen_vl_expand(model, images, tok, text, imgs)
    x = torch.tensor([ids])
    pad = model.config.image_token_id
    expected, delta = model.model.get_rope_index(
        x, mm_token_type_ids=(x == pad).int(), image_grid_thw=kwargs["image_grid_thw"])
    expected = expected[:, 0].numpy()
    inputs, at = [], 0
    for grid in kwargs["image_grid_thw"].tolist():
        offset = ids.index(pad, at)
        rows = grid[0] * grid[1] * grid[2] // 4
        inputs.append(MultiModalInput.of(b"", [], offset, rows, grid,
                                         [grid[0], grid[1] // 2, grid[2] // 2]))
        at = offset + rows
    n = len(ids)
    for start, end in ((0, n), (0, 5), (3, 17), (7, n), (n - 1, n)):
        assert np.array_equal(rope_positions(inputs, start, end), expected[:, start:end])
    generated = rope_positions(inputs, n, n + 3)
    assert np.array_equal(generated, np.arange(n, n + 3) + int(delta) + np.zeros((3, 1)))


def test_greedy_tokens_equal_transformers(qwen_vl):
    path, model, images, tok = qwen_vl
    expected = [qwen_vl_greedy(model, images, tok, text, [image(*i) for i in imgs])
                for text, imgs in REQUESTS]
    # 16-token steps: prompts reach their images over several chunks
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16) as llm:
        compiled = [p for p in llm.engine.core.runner.paths
                    if isinstance(p, step_paths.CompiledCpuPath)]
        taken = []  # (decodes after an image: shifted positions, the compiled step)

        def spied(step, forward=compiled[0].forward if compiled else None):
            out = forward(step)
            taken.append(out is not None and len(step.inputs.rope_positions) > 0)
            return out
        if compiled:
            compiled[0].forward = spied
        outs = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    assert any(taken) or not compiled
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_preemption_prefix_cache_and_tensor_parallel(qwen_vl):
    """Requests preempting each other recompute with the same positions; a repeated image
    reuses its prefix's blocks, another image none; two tensor-parallel ranks (rank 1 reads
    the positions from the step's message) give the same tokens."""
    path, model, images, tok = qwen_vl
    text = REQUESTS[0][0]
    requests = [(text, [(s, 90, 50), (s + 1, 64, 40)]) for s in range(4)]
    expected = [qwen_vl_greedy(model, images, tok, t, [image(*i) for i in imgs])[1]
                for t, imgs in requests]
    with LLM(path, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16) as llm:
        outs = llm.generate(_prompts(requests), GREEDY, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    with LLM(path, kv_cache_memory_gib=0.02, block_size=8) as llm:
        first, again, other = (llm.generate(_prompts(r), GREEDY, use_tqdm=False)[0]
                               for r in (requests[:1], requests[:1], requests[1:2]))
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == 24 and again.outputs == first.outputs
    assert other.num_cached_tokens == 0
    with LLM(path, kv_cache_memory_gib=0.02, max_num_batched_tokens=16,
             tensor_parallel_size=2) as llm:
        outs = llm.generate(_prompts(requests[:2]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]


def test_an_image_larger_than_the_context_is_refused_before_processing(qwen_vl):
    path = qwen_vl[0]
    with LLM(path, kv_cache_memory_gib=0.02, max_model_len=40) as llm:
        calls = []
        inputs = llm._image_inputs()
        processor = inputs.processor
        inputs.processor = type("Spy", (), {
            "get_number_of_image_patches": processor.get_number_of_image_patches,
            "__call__": lambda self, **kw: calls.append(kw) or processor(**kw)})()
        with pytest.raises(ValueError, match=r"makes 64 tokens, more than max_model_len \(40\)"):
            llm.generate([{"prompt": f"a {IMAGE}", "multi_modal_data": {
                "image": image(1, 400, 400)}}], GREEDY, use_tqdm=False)
        assert calls == []
        out = llm.generate([{"prompt": f"a {IMAGE}", "multi_modal_data": {
            "image": image(2, 30, 30)}}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and len(calls) == 1


def test_speculative_and_quantized_text_parts(qwen_vl, request):
    """N-gram drafts after an image are verified at their M-RoPE positions (the same greedy
    tokens as without); the int8-quantized language model takes image requests too."""
    if "2.5" not in request.node.callspec.id:
        pytest.skip("one version suffices")
    path, model, images, tok = qwen_vl
    expected = [qwen_vl_greedy(model, images, tok, text, [image(*i) for i in imgs])[1]
                for text, imgs in REQUESTS]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with LLM(path, kv_cache_memory_gib=0.02, speculative_config=spec) as llm:
        drafted = [o.outputs[0].token_ids for o in llm.generate(_prompts(REQUESTS), GREEDY,
                                                                use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.02, quantization="int8") as llm:
        quantized = llm.generate(_prompts(REQUESTS), GREEDY, use_tqdm=False)
    assert drafted == expected
    assert all(len(o.outputs[0].token_ids) == 8 for o in quantized)
