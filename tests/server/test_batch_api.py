"""OpenAI's Files and Batch APIs through the `openai` SDK: a JSONL uploaded with
`files.create`, a batch over it with `batches.create`, its output lines equal to the same
requests sent live (greedy), refused lines in its error file, counts, listing, a cancel that
stops a running batch between lines, and the bad inputs (oversized upload, another purpose,
unknown ids, another endpoint) refused in OpenAI's shape."""

import json

import openai
import pytest

from tests.serving import service_over_engine, wait_until
from tokenmill.config.engine import EngineConfig

CHAT = {"model": "tiny", "max_tokens": 6, "temperature": 0}
PROMPTS = ["Say hi", "Name a color", "Count to three"]


def _line(custom_id, body, url="/v1/chat/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def client(tiny_models, tmp_path_factory):
    path = tiny_models("llama")[0]
    engine = {"scheduling_policy": "priority"}
    with service_over_engine(path, engine=engine,
                             engine_config=EngineConfig(model=path, **engine),
                             batch_dir=str(tmp_path_factory.mktemp("batches")),
                             max_batch_file_bytes=64 * 1024) as thread:
        yield openai.OpenAI(base_url=thread.base + "/v1", api_key="x", max_retries=0)


def _finished(client, batch_id):
    wait_until(lambda: client.batches.retrieve(batch_id).status in (
        "completed", "failed", "cancelled"), timeout=300)
    return client.batches.retrieve(batch_id)


def test_a_batch_answers_as_live_requests(client):
    lines = [_line(f"q{i}", {**CHAT, "messages": [{"role": "user", "content": p}]})
             for i, p in enumerate(PROMPTS)]
    lines += [_line("wrong-url", {"model": "tiny", "prompt": "x"}, url="/v1/completions"),
              _line("too-long", {**CHAT, "max_tokens": 10**6, "messages": [
                  {"role": "user", "content": "x"}]}), "{not json"]
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len("\n".join(lines).encode())
    assert client.files.content(upload.id).content == "\n".join(lines).encode()
    assert upload.id in [f.id for f in client.files.list().data]
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "t"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "t"}
    done = _finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 3, 3)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    for result in out:
        i = int(result["custom_id"][1:])
        live = client.chat.completions.create(messages=[{"role": "user",
                                                         "content": PROMPTS[i]}], **CHAT)
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200 and result["error"] is None
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert body["usage"]["completion_tokens"] == live.usage.completion_tokens
    assert sorted(r["custom_id"] for r in out) == ["q0", "q1", "q2"]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["wrong-url"]["error"]["code"] == "invalid_url"
    assert by_id["too-long"]["response"]["status_code"] == 400
    assert by_id[None]["error"]["code"] == "invalid_json"
    assert batch.id in [b.id for b in client.batches.list().data]
    assert client.batches.cancel(batch.id).status == "completed"  # (over: nothing to stop)


def test_cancel_stops_a_running_batch(client):
    lines = [_line(f"long{i}", {**CHAT, "max_tokens": 120, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"story {i}"}]})
             for i in range(40)]
    upload = client.files.create(file=("long.jsonl", "\n".join(lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts.completed < 40


def test_bad_inputs(client):
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", b"x" * (65 * 1024)), purpose="batch")
    assert big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-" + "0" * 24)
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../etc/passwd")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 24)
    upload = client.files.create(file=("a.jsonl", b"{}"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "1" * 24,
                              endpoint="/v1/chat/completions", completion_window="24h")
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
