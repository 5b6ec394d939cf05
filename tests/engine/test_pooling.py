"""Pooling models offline (`LLM.embed` / `classify` / `score`) against sentence-transformers
on tiny random models: embeddings of every pooling type through chunked prefill, Dense
layers, truncation, a cross-encoder's scores; and what the engine refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_cross_encoder, make_embedding_model, make_model

from tokenmill import LLM
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

TEXTS = ["hello world", "Tokens",
         "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3]
PAIRS = [("what is the capital of France?", "Paris is the capital of France."),
         ("what is the capital of France?", "The quick brown fox jumps over the lazy dog."),
         ("tokens", "Tokens flow through the mill, batch after batch")]
# 16-token steps: the long text's prompt is pooled over four chunks
ENGINE = {"kv_cache_memory_gib": 0.02, "max_num_batched_tokens": 16}


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pooling") / "llama")
    make_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pooling") / "cross")
    return path, make_cross_encoder(path)


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls", "max"])
def test_embeddings_equal_sentence_transformers(base, tmp_path, mode):
    reference = make_embedding_model(str(tmp_path / "emb"), base, mode)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    with LLM(str(tmp_path / "emb"), **ENGINE) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
        # the same long input again: a prefix-cache hit must not change what is pooled
        again = llm.embed(TEXTS[2:], use_tqdm=False)[0].outputs.embedding
    assert np.asarray(got).shape == expected.shape
    assert cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(again, got[2], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def test_dense_layer_and_dimensions(base, tmp_path):
    reference = make_embedding_model(str(tmp_path / "emb"), base, "mean", dense=32)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    with LLM(str(tmp_path / "emb"), **ENGINE) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
        short = [o.outputs.embedding for o in llm.embed(
            TEXTS, PoolingParams(dimensions=8), use_tqdm=False)]
        raw = [o.outputs.embedding for o in llm.embed(
            TEXTS, PoolingParams(normalize=False), use_tqdm=False)]
        with pytest.raises(ValueError, match="dimensions must be at most the model's 32"):
            llm.embed(TEXTS, PoolingParams(dimensions=33), use_tqdm=False)
        with pytest.raises(ValueError, match="Got 2 pooling params for 3 prompts"):
            llm.encode(TEXTS, [PoolingParams()] * 2, use_tqdm=False)
        with pytest.raises(ValueError, match="Got 2 LoRA requests for 3 prompts"):
            llm.encode(TEXTS, lora_request=[None, None], use_tqdm=False)
    assert len(got[0]) == 32
    assert cosines(got, expected).min() >= 0.9999
    # Matryoshka: the first 8 values, renormalized (sentence-transformers' truncate_dim)
    truncated = reference.encode(TEXTS, convert_to_numpy=True, truncate_dim=8)
    assert cosines(short, truncated).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(short, axis=-1), 1.0, atol=1e-5)
    # unnormalized: the Dense layer's output itself (tanh: inside [-1, 1], not unit length)
    assert cosines(raw, expected).min() >= 0.9999
    assert abs(np.linalg.norm(raw[2]) - 1.0) > 1e-3


def test_cross_encoder_scores_equal_sentence_transformers(cross_encoder):
    path, reference = cross_encoder
    expected = reference.predict(PAIRS)
    with LLM(path, **ENGINE) as llm:
        scores = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
        one_to_many = llm.score(PAIRS[0][0], [b for _, b in PAIRS[:2]], use_tqdm=False)
        classified = llm.classify([PAIRS[2][0]], use_tqdm=False)[0].outputs.probs
        raw = llm.encode([PAIRS[2][0]], PoolingParams(task="classify", use_activation=False),
                         use_tqdm=False)[0].pooled
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=1e-4)
    np.testing.assert_allclose([s.outputs.score for s in one_to_many], expected[:2], atol=1e-4)
    assert len(classified) == 1
    np.testing.assert_allclose(classified[0], torch.sigmoid(torch.tensor(raw[0])).item(),
                               atol=1e-6)


def test_embedding_model_scores_by_cosine(base, tmp_path):
    reference = make_embedding_model(str(tmp_path / "emb"), base, "lasttoken")
    first = reference.encode([a for a, _ in PAIRS], convert_to_numpy=True)
    second = reference.encode([b for _, b in PAIRS], convert_to_numpy=True)
    with LLM(str(tmp_path / "emb"), **ENGINE) as llm:
        scores = [s.outputs.score for s in llm.score([a for a, _ in PAIRS],
                                                     [b for _, b in PAIRS], use_tqdm=False)]
        with pytest.raises(ValueError, match="as many as text_2"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    np.testing.assert_allclose(scores, cosines(first, second), atol=1e-4)


def test_pooling_and_generating_models_refuse_each_others_requests(base, tmp_path,
                                                                   cross_encoder):
    make_embedding_model(str(tmp_path / "emb"), base, "mean")
    with LLM(str(tmp_path / "emb"), **ENGINE) as llm:
        with pytest.raises(ValueError, match="generates no text"):
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="an embedding model"):
            llm.classify(["hello"], use_tqdm=False)
    with LLM(cross_encoder[0], **ENGINE) as llm, pytest.raises(ValueError,
                                                              match="a classifier"):
        llm.embed(["hello"], use_tqdm=False)
    # the causal LM served as an embedding model (--runner pooling): last token, normalized
    with LLM(base, runner="pooling", **ENGINE) as llm:
        pooled = llm.embed(["hello world"], use_tqdm=False)[0]
    with LLM(base, **ENGINE) as llm:
        assert llm.engine.pooler is None
        with pytest.raises(ValueError, match="pools nothing"):
            llm.embed(["hello"], use_tqdm=False)
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(base).eval()
    with torch.no_grad():
        last = hf(torch.tensor([pooled.prompt_token_ids])).last_hidden_state[0, -1]
    np.testing.assert_allclose(pooled.outputs.embedding,
                               torch.nn.functional.normalize(last, dim=-1).numpy(), atol=1e-5)


def test_pooler_config_is_checked(base):
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(base, runner="pooling", pooler_config={"pooling_type": "median"}, **ENGINE)
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(base, pooler_config='{"pooling_type": "MEAN"}', **ENGINE)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(base, runner="embed", **ENGINE)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS", "MAX"])
def test_chunked_pooling_equals_the_slow_reference(kind):
    """The per-chunk reduction carried across chunks equals pooling all rows at once."""
    from tokenmill.worker.pooler import combine, pool_slow, reduce_rows

    hidden = torch.randn(23, 8, generator=torch.Generator().manual_seed(3))
    state = None
    for start in range(0, 23, 5):
        part = reduce_rows(hidden[start:start + 5], kind)
        state = part if state is None else combine(state, part, kind)
    if kind == "MEAN":
        state = state / 23
    torch.testing.assert_close(state, pool_slow(hidden, kind))


def test_tensor_parallel_pools_as_one_rank(base, tmp_path, cross_encoder):
    """Two tensor-parallel ranks: rank 0 pools the full hidden states (every rank computes
    them), the other rank's pooler idle."""
    reference = make_embedding_model(str(tmp_path / "emb"), base, "mean")
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    with LLM(str(tmp_path / "emb"), tensor_parallel_size=2, **ENGINE) as llm:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    assert cosines(got, expected).min() >= 0.9999
    path, cross = cross_encoder
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        scores = [s.outputs.score for s in llm.score(PAIRS[0][0], [b for _, b in PAIRS],
                                                     use_tqdm=False)]
    np.testing.assert_allclose(scores, cross.predict([(PAIRS[0][0], b) for _, b in PAIRS]),
                               atol=1e-4)


def test_a_qwen3_embedding_style_folder(tmp_path):
    """Qwen3-Embedding's recipe: a bare Qwen3Model (tied embeddings, q/k norms) under
    last-token pooling and normalization."""
    base = str(tmp_path / "qwen3")
    make_model(base, "qwen3")
    reference = make_embedding_model(str(tmp_path / "emb"), base, "lasttoken")
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    with LLM(str(tmp_path / "emb"), **ENGINE) as llm:
        assert type(llm.engine.core.runner.model).__name__ == "LlamaForCausalLM"
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    assert cosines(got, expected).min() >= 0.9999


def test_the_command_line_names_the_runner():
    """vLLM's --task spellings mean the pooling or generate runner; --pooler-config,
    --limit-mm-per-prompt and --allowed-media-domains reach the configuration."""
    from tokenmill.config.server import build_server_config

    config = build_server_config(["m", "--task", "embed", "--pooler-config",
                                  '{"pooling_type": "mean"}', "--limit-mm-per-prompt",
                                  '{"image": 3}', "--allowed-media-domains", "a.com"],
                                 environ={})
    assert config.engine.runner == "pooling"
    assert config.engine.pooler_config == {"pooling_type": "mean"}
    assert config.engine.limit_mm_per_prompt == {"image": 3}
    assert config.allowed_media_domains == ["a.com"]
    assert build_server_config(["m", "--task", "score"], environ={}).engine.runner == "pooling"
    assert build_server_config(["m"], environ={}).engine.runner == "auto"
    with pytest.raises(ValueError, match="--task generate asks for the generate runner"):
        build_server_config(["m", "--task", "generate", "--runner", "pooling"], environ={})
    with pytest.raises(ValueError, match="limit_mm_per_prompt takes"):
        build_server_config(["m", "--limit-mm-per-prompt", '{"video": 1}'], environ={})
