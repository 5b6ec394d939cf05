"""A pooling model's routes through their real clients: `openai`'s `embeddings.create`
(floats, base64, `dimensions`) against sentence-transformers; `/pooling`, `/classify`;
`/score`, `/v1/score` and `/rerank` / `/v1/rerank` (Cohere's and Jina's shape) of a
cross-encoder against CrossEncoder and of an embedding model against its cosine; and the
routes each kind of model refuses, in the OpenAI error shape."""

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from helpers import make_cross_encoder, make_embedding_model, make_model

from tests.serving import service_over_engine, wait_until

TEXTS = ["hello world", "Tokens",
         "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 3]
QUERY = "what is the capital of France?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
             "Tokens flow through the mill, batch after batch"]


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_pooling")
    make_model(str(root / "base"), "llama")
    reference = make_embedding_model(str(root / "emb"), str(root / "base"), "mean", dense=32)
    with service_over_engine(str(root / "emb"), engine={"max_num_batched_tokens": 16},
                             batch_dir=str(root / "batches")) as t:
        yield t, reference


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served_pooling") / "cross")
    reference = make_cross_encoder(path)
    with service_over_engine(path) as thread:
        yield thread, reference


def test_openai_embeddings_equal_sentence_transformers(embedder):
    thread, reference = embedder
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert cosines([d.embedding for d in floats.data], expected).min() >= 0.9999
    assert floats.usage.prompt_tokens == sum(len(reference.tokenizer(t)["input_ids"])
                                             for t in TEXTS)
    # the SDK asks for base64 by default and decodes it: the same floats
    packed = client.embeddings.create(model="tiny", input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in packed.data],
                               [d.embedding for d in floats.data], atol=1e-6)
    short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=8,
                                     encoding_format="float")
    truncated = reference.encode(TEXTS[:1], convert_to_numpy=True, truncate_dim=8)
    assert cosines([short.data[0].embedding], truncated).min() >= 0.9999
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, floats.data[1].embedding, atol=1e-6)


def test_raw_base64_and_pooling_route(embedder):
    thread, _ = embedder
    raw = httpx.post(thread.base + "/v1/embeddings", json={
        "input": "hello world", "encoding_format": "base64"}, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    pooled = httpx.post(thread.base + "/pooling", json={"input": ["hello world"]},
                        timeout=60).json()
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(vector, pooled["data"][0]["data"], atol=1e-6)
    assert len(vector) == 32


def test_embedding_model_scores_and_reranks_by_cosine(embedder):
    thread, reference = embedder
    query = reference.encode([QUERY], convert_to_numpy=True)
    docs = reference.encode(DOCUMENTS, convert_to_numpy=True)
    expected = cosines(np.repeat(query, len(DOCUMENTS), axis=0), docs)
    score = httpx.post(thread.base + "/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                       timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected, atol=1e-4)
    ranked = httpx.post(thread.base + "/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                      "top_n": 2}, timeout=60).json()
    best = np.argsort(-expected)[:2].tolist()
    assert [r["index"] for r in ranked["results"]] == best
    assert ranked["results"][0]["document"] == {"text": DOCUMENTS[best[0]]}


def test_cross_encoder_routes_equal_cross_encoder(reranker):
    thread, reference = reranker
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    for path in ("/score", "/v1/score"):
        body = httpx.post(thread.base + path, json={"model": "tiny", "text_1": QUERY,
                                                    "text_2": DOCUMENTS}, timeout=60).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
    order = np.argsort(-expected).tolist()
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # (Jina's documents as objects too)
        body = httpx.post(thread.base + path, json={
            "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
            "return_documents": False}, timeout=60).json()
        assert [r["index"] for r in body["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   expected[order], atol=1e-4)
        assert "document" not in body["results"][0] and body["usage"]["total_tokens"] > 0
    classified = httpx.post(thread.base + "/classify", json={"input": [QUERY]},
                            timeout=60).json()["data"][0]
    assert classified["num_classes"] == 1 and classified["label"] == "LABEL_0"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[100000]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "model": "nope"}, "model"),
    ("/v1/embeddings", {"input": ["hi"] * 3000}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_1"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/classify", {"input": "hi"}, "model"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 33}, "dimensions"),
])
def test_bad_requests_get_400_in_the_openai_shape(embedder, path, body, param):
    thread, _ = embedder
    response = httpx.post(thread.base + path, json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and "Traceback" not in error["message"]
    # the server still answers
    assert httpx.post(thread.base + "/v1/embeddings", json={"input": "ok"},
                      timeout=60).status_code == 200


def test_each_kind_of_model_refuses_the_others_routes(embedder, server):
    thread, _ = embedder
    text = httpx.post(thread.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=60)
    assert text.status_code == 400 and "generates no text" in text.json()["error"]["message"]
    native = httpx.post(thread.base + "/v1/chat/completions", json={"text": "hi"}, timeout=60)
    assert native.status_code == 400 and "generates no text" in native.text
    triton = httpx.post(thread.base + "/v2/models/tiny/generate", json={
        "text_input": "hi", "max_tokens": 2}, timeout=60)
    assert triton.status_code == 400 and "generates no text" in triton.json()["error"]
    embeddings = httpx.post(server + "/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert embeddings.status_code == 400
    assert "pooling model" in embeddings.json()["error"]["message"]


def test_a_batch_of_embeddings_answers_as_live_requests(embedder):
    thread, _ = embedder
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": text, "encoding_format": "float"}})
             for i, text in enumerate(TEXTS)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                             "body": {"input": []}}))
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in (
        "completed", "failed", "cancelled"), timeout=300)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    for result in out:
        live = client.embeddings.create(model="tiny", input=TEXTS[int(result["custom_id"][1:])],
                                        encoding_format="float")
        np.testing.assert_allclose(result["response"]["body"]["data"][0]["embedding"],
                                   live.data[0].embedding, atol=1e-6)


def test_a_request_of_2048_inputs_runs_in_a_window(embedder):
    """OpenAI's largest embeddings request: admitted as the window's sequences (more than
    the queue holds at once), every input answered, in order."""
    thread, _ = embedder
    inputs = [[5 + i % 7, 9] for i in range(2048)]
    body = httpx.post(thread.base + "/v1/embeddings", timeout=300, json={
        "input": inputs, "encoding_format": "float"}).json()
    assert [d["index"] for d in body["data"]] == list(range(2048))
    for i in (0, 7, 2047):
        np.testing.assert_allclose(body["data"][i]["embedding"],
                                   body["data"][i % 7]["embedding"], atol=1e-6)
    assert body["usage"]["prompt_tokens"] == 4096
