"""Adapters through `tokenmill serve` on every front end: the native API and Triton's
generate (HTTP and KServe gRPC) pick one by TensorRT-LLM's `lora_task_id` (Triton also by the
model name), answering as the OpenAI route does for that adapter (itself checked against
peft in test_lora_server.py); unknown ids are refused in each route's shape; a bad adapter
stops start-up with one line."""

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.lora.trtllm_convert import trtllm_tensors
from tests.serving import Served, wait_until

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXT = "the quick brown fox"


@pytest.fixture(scope="module")
def served(tiny_models, adapters, tmp_path_factory):
    a_path, _ = adapters("llama", "mix-a", seed=1, target_modules=ATTN_MLP)
    b_path, _ = adapters("llama", "mix-b", seed=2, r=16,
                         target_modules=["q_proj", "v_proj", "down_proj"])
    flags = ["--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={a_path}",
             f"chat={b_path}"]
    with Served(tiny_models("llama")[0], tmp_path_factory.mktemp("lora"),
                *flags).running() as s:
        yield s


def _openai(served, model: str, **body) -> str:
    resp = httpx.post(served.api + "/v1/completions", json={
        "model": model, "max_tokens": 8, "temperature": 0, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_native_lora_task_id(served):
    ids = [5, 9, 23, 41, 7, 3]
    got = {}
    for task, model in ((None, "tiny"), (1, "sql"), (2, "chat")):
        body = {"input_ids": ids, "temperature": 0, "max_dec_len": 8}
        if task is not None:
            body["lora_task_id"] = task
        resp = httpx.post(served.api + "/v1/chat/completions", json=body, timeout=60).json()
        assert resp["error_code"] == 0, resp
        got[model] = resp["result"]
        assert got[model] == _openai(served, model, prompt=ids)
    assert len(set(got.values())) == 3
    bad = httpx.post(served.api + "/v1/chat/completions",
                     json={"input_ids": ids, "lora_task_id": 7}, timeout=60)
    assert bad.status_code == 404 and "lora_task_id" in bad.json()["error_msg"]
    wrong = httpx.post(served.api + "/v1/chat/completions",
                       json={"input_ids": ids, "lora_task_id": "x"}, timeout=60)
    assert wrong.status_code == 400 and "must be an integer" in wrong.json()["error_msg"]


def test_triton_generate_by_task_id_and_model(served):
    def generate(model: str, **fields) -> httpx.Response:
        return httpx.post(f"{served.api}/v2/models/{model}/generate", json={
            "text_input": TEXT, "max_tokens": 8, "temperature": 0.0,
            "exclude_input_in_output": True, **fields}, timeout=60)

    expected = _openai(served, "sql", prompt=TEXT)
    assert expected != _openai(served, "tiny", prompt=TEXT)
    for model, fields in (("ensemble", {"lora_task_id": 1}), ("sql", {}),
                          ("sql", {"lora_task_id": 1})):
        resp = generate(model, **fields)
        assert resp.status_code == 200, resp.text
        assert resp.json()["text_output"] == expected
    cases = [(generate("ensemble", lora_task_id=9), 404, "LoRA task 9 not found"),
             (generate("sql", lora_task_id=2), 400, "is adapter 'chat'"),
             (generate("ensemble", lora_weights=[[0.0]]), 400, "sent together, with the "
                                                                "lora_task_id")]
    for resp, status, fragment in cases:
        assert resp.status_code == status and set(resp.json()) == {"error"}, resp.text
        assert fragment in resp.json()["error"]


def test_grpc_lora_task_id(served):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    try:
        def infer(task=None):
            inputs = []
            for name, dtype, value in (("text_input", "BYTES", TEXT), ("max_tokens", "INT32", 8),
                                       ("exclude_input_in_output", "BOOL", True),
                                       ("temperature", "FP32", 0.0),
                                       *((("lora_task_id", "UINT64", task),) if task else ())):
                x = grpcclient.InferInput(name, [1, 1], dtype)
                np_type = {"BYTES": object, "INT32": np.int32, "BOOL": bool,
                           "FP32": np.float32, "UINT64": np.uint64}[dtype]
                x.set_data_from_numpy(np.array([[value]], dtype=np_type))
                inputs.append(x)
            out = client.infer("ensemble", inputs)
            return out.as_numpy("text_output").reshape(-1)[0].decode()

        assert infer(2) == _openai(served, "chat", prompt=TEXT)
        assert infer() == _openai(served, "tiny", prompt=TEXT)
        with pytest.raises(InferenceServerException, match="LoRA task 5 not found"):
            infer(5)
    finally:
        client.close()


def test_adapter_sent_as_tensors(served, adapters):
    """TensorRT-LLM's lora_weights / lora_config with a lora_task_id register that adapter
    (the tensors of --lora-modules' "sql", converted as hf_lora_convert.py does): it answers
    as "sql" does, then by the id alone, over HTTP and gRPC; bad tensors are refused in each
    route's shape and register nothing."""
    a_path, _ = adapters("llama", "mix-a", seed=1, target_modules=ATTN_MLP)
    weights, config = trtllm_tensors(a_path)
    expected = _openai(served, "sql", prompt=TEXT)

    def generate(**fields) -> httpx.Response:
        return httpx.post(f"{served.api}/v2/models/ensemble/generate", json={
            "text_input": TEXT, "max_tokens": 8, "temperature": 0.0,
            "exclude_input_in_output": True, **fields}, timeout=60)

    sent = generate(lora_task_id=77, lora_weights=weights.tolist(), lora_config=config.tolist())
    assert sent.status_code == 200, sent.text
    assert sent.json()["text_output"] == expected
    again = generate(lora_task_id=77)
    assert again.status_code == 200 and again.json()["text_output"] == expected
    bad_config = config.copy()
    bad_config[0, 0] = 13
    cases = [(generate(lora_task_id=1, lora_weights=weights.tolist(),
                       lora_config=config.tolist()), 400, "is the adapter 'sql'"),
             (generate(lora_task_id=78, lora_weights=weights.tolist(),
                       lora_config=bad_config.tolist()), 400, "module id 13 (moe_h_to_4h)"),
             (generate(lora_task_id=79, lora_weights=weights[:, :10].tolist(),
                       lora_config=config.tolist()), 400, "holds 10 values"),
             (generate(lora_task_id=78), 404, "LoRA task 78 not found")]
    for resp, status, fragment in cases:
        assert resp.status_code == status and set(resp.json()) == {"error"}, resp.text
        assert fragment in resp.json()["error"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    try:
        inputs = []
        for name, dtype, value in (("text_input", "BYTES", np.array([[TEXT]], dtype=object)),
                                   ("max_tokens", "INT32", np.array([[8]], dtype=np.int32)),
                                   ("exclude_input_in_output", "BOOL", np.array([[True]])),
                                   ("temperature", "FP32", np.array([[0.0]], dtype=np.float32)),
                                   ("lora_task_id", "UINT64", np.array([[88]], dtype=np.uint64)),
                                   ("lora_weights", "FP32", weights[None]),
                                   ("lora_config", "INT32", config[None])):
            tensor = grpcclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        out = client.infer("ensemble", inputs)
        assert out.as_numpy("text_output").reshape(-1)[0].decode() == expected
    finally:
        client.close()
    names = {m["id"] for m in httpx.get(served.api + "/v1/models", timeout=30).json()["data"]}
    assert {"trtllm-task-77", "trtllm-task-88"} <= names
    assert not names & {"trtllm-task-78", "trtllm-task-79"}


def test_bad_adapter_stops_start_up(tiny_models, tmp_path):
    server = Served(tiny_models("llama")[0], tmp_path, "--enable-lora", "--lora-modules",
                    f"broken={tmp_path / 'nowhere'}")
    server.start()
    try:
        assert server.process.wait(300) != 0
        log = server.process.stdout.read().decode()
        assert "LoRA adapter 'broken': no adapter_config.json in its folder" in log
    finally:
        server.stop()


def test_lora_requests_info_metric(served):
    """vLLM's lora_requests_info: the adapters of running requests while one runs, none
    after; one series at a time."""
    from prometheus_client.parser import text_string_to_metric_families

    def series() -> list[dict]:
        text = httpx.get(served.metrics + "/metrics", timeout=10).text
        return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tokenmill:lora_requests_info"]

    with httpx.stream("POST", served.api + "/v1/completions", json={
            "model": "chat", "prompt": [5, 9, 23], "max_tokens": 1000, "temperature": 0,
            "stream": True, "ignore_eos": True}, timeout=120) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # (running now)
        # (the engine's stats reach the metrics port with each step; the bound guards a hang;
        # the scrape that shows it running is the one checked: the request may finish
        # before a second scrape. The model's whole context, ~0.4 s here: 400 tokens were
        # done before the first scrape on a busy machine once)
        snapshots = []
        assert wait_until(lambda: snapshots.append(series()) or [
            s["running_lora_adapters"] for s in snapshots[-1]] == ["chat"], 60)
        seen = snapshots[-1]
        assert len(seen) == 1 and seen[0]["running_lora_adapters"] == "chat", seen
        assert seen[0]["max_lora"] == "2" and seen[0]["waiting_lora_adapters"] == ""
        for _ in lines:
            pass
    assert wait_until(lambda: [s["running_lora_adapters"] for s in series()] == [""], 60)
