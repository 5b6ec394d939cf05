"""`tokenmill run-batch` (vLLM's run_batch format): every request line answered as the same
body sent live to a server over the same model answers it (greedy: equal choices and usage),
in the input's order; lines that are no request get an error entry naming why; the engine
stops with the command."""

import json
import subprocess
import sys

import httpx

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
        "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": [5, 9, 23, 41], "max_tokens": 6, "temperature": 0,
              "logprobs": 1}
LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions", "body": COMPLETION},
    {"custom_id": "bad-1", "method": "POST", "url": "/v1/completions",
     "body": {**COMPLETION, "max_tokens": 10**6}},
    {"custom_id": "url-1", "method": "POST", "url": "/v1/embeddings", "body": {}},
    {"method": "POST", "url": "/v1/completions", "body": COMPLETION},
]


def _same(got: dict, want: dict) -> None:
    for key in ("id", "created"):
        got.pop(key), want.pop(key)
    assert got == want


def test_run_batch_answers_as_the_server(tiny_models, tmp_path, server):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES)
                      + "{not json\n\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "run-batch",
                           "-i", str(source), "-o", str(out), tiny_models("llama")[0],
                           "--served-model-name", "tiny", "--max-model-len", "512",
                           "--kv-cache-memory", "0.02"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat-1", "cmpl-1", "bad-1", "url-1", None,
                                                  None]
    live = [httpx.post(server + path, json=body, timeout=60)
            for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                               ("/v1/completions", LINES[2]["body"]))]
    for result, response in zip(results[:3], live):
        assert result["error"] is None
        assert result["response"]["status_code"] == response.status_code
        if response.status_code == 200:
            _same(result["response"]["body"], response.json())
    assert results[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert [r["error"]["code"] for r in results[3:]] == ["invalid_url", "missing_custom_id",
                                                         "invalid_json"]
    assert all(r["response"] is None for r in results[3:])
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_run_batch_refuses_a_missing_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.openai.run_batch",
                           "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not a file" in done.stderr
    assert "Traceback" not in done.stderr
