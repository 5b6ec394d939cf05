"""A GGUF language model with llama.cpp's vision projector file beside it (`--mmproj`): a
tiny Gemma 3 written as llama.cpp ships one (a gemma3 GGUF, an mmproj file named and laid
out as its converter writes them, the projection matrix in f16 as it forces) answers image
requests as transformers' model does with that f16 rounding and the GGUF's tokenizer; a
projector of another type, or an mmproj beside a folder checkpoint, is refused naming why."""

import os

import pytest
import torch
from helpers import GEMMA3_IMAGE, gemma3_greedy, make_gemma3_vl, write_gemma3_gguf
from helpers import random_image as image

from tokenmill import LLM, SamplingParams
from tokenmill.loading.gguf_tokenizer import load_gguf_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
B = GEMMA3_IMAGE


@pytest.fixture(scope="module")
def gguf_gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_gemma3")
    model, images, tok = make_gemma3_vl(str(folder / "hf"))
    language, mmproj = write_gemma3_gguf(str(folder), model, tok)
    # the GGUF's tokenizer as transformers rebuilds it (its newline runs: single newlines)
    tok = load_gguf_tokenizer(language)
    with torch.no_grad():  # (the file's projection is f16: so is the reference's)
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        weight.copy_(weight.half().float())
    return language, mmproj, model, images, tok


def test_images_through_an_mmproj_equal_transformers(gguf_gemma3):
    language, mmproj, model, images, tok = gguf_gemma3
    requests = [(f"The quick {B} brown fox and {B} jumps", [(1, 40, 50), (2, 64, 32)]),
                (f"Paris is\n{B}\n\nthe capital", [(3, 30, 30)]),
                ("Tokens flow through the mill", [])]
    expected = [gemma3_greedy(model, images, tok, text, [image(*i) for i in imgs])
                for text, imgs in requests]
    with LLM(language, mmproj=mmproj, kv_cache_memory_gib=0.02,
             max_num_batched_tokens=16) as llm:
        assert llm.engine.multimodal.mmproj == mmproj
        outs = llm.generate([{"prompt": t, "multi_modal_data": {
            "image": [image(*i) for i in imgs]}} if imgs else t for t, imgs in requests],
            GREEDY, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_mmproj_refusals(gguf_gemma3, tmp_path):
    import gguf

    language, mmproj = gguf_gemma3[:2]
    other = str(tmp_path / "mmproj-other.gguf")
    writer = gguf.GGUFWriter(other, "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="projector type 'qwen2.5vl_merger' is not served"):
        LLM(language, mmproj=other, kv_cache_memory_gib=0.02)
    with pytest.raises(ValueError, match="goes with a GGUF language model"):
        LLM(os.path.join(os.path.dirname(language), "hf"), mmproj=mmproj,
            kv_cache_memory_gib=0.02)
    with pytest.raises(ValueError, match="no such file"):
        LLM(language, mmproj=str(tmp_path / "absent.gguf"), kv_cache_memory_gib=0.02)
    with pytest.raises(ValueError, match="not a llama.cpp vision projector"):
        LLM(language, mmproj=language, kv_cache_memory_gib=0.02)
