"""bench/compare.py's own arithmetic: the table's best runs and ratios, the fp32 rate of
tokenmill's kernel that the roofline's throughput ceiling takes when it beats torch's, and the
workload ceilings of bench/roofline.py against a token-by-token count."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import make_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import compare  # noqa: E402 - scripts in bench/, not a package
import roofline  # noqa: E402


def _run(engine, workload, tps, repeat=0):
    key = "decode_tps" if workload == "w2" else "out_tps"
    return {"engine": engine, "workload": workload, key: tps, "repeat": repeat}


def test_table_keeps_each_engines_best_run_and_the_ratio_to_the_best_peer():
    runs = [_run("tokenmill", "w1", 100.0), _run("vllm", "w1", 80.0),
            _run("llamacpp", "w1", 90.0), _run("tokenmill", "w1", 120.0, 1),
            _run("vllm", "w1", 60.0, 1), _run("tokenmill", "w2", 10.0),
            _run("llamacpp", "w2", 20.0), {"engine": "vllm", "workload": "w2", "error": "x"}]
    table = compare._table(runs, ["tokenmill", "vllm", "llamacpp"])
    assert table["w1"]["tokenmill"]["out_tps"] == 120.0
    assert table["w1"]["vllm"]["out_tps"] == 80.0
    assert table["w1"]["_ratio_to_best_peer"] == {"peer": "llamacpp", "ratio": round(120 / 90, 3)}
    assert "vllm" not in table["w2"]  # a failed run is no cell
    assert table["w2"]["_ratio_to_best_peer"] == {"peer": "llamacpp", "ratio": 0.5}


def test_tokenmill_matmul_rate_is_measured_on_the_loaders_fp32_kernel(monkeypatch):
    calls = []
    real = roofline._timed
    monkeypatch.setattr(roofline, "_timed", lambda fn: calls.append(fn) or real(fn))
    x, w = torch.randn(96, 128), torch.randn(192, 128)
    rate = roofline.tokenmill_matmul_gflops(x, w)
    if rate is None:  # a torch without oneDNN: fp32 layers stay plain torch
        pytest.skip("no packed fp32 kernel here")
    assert rate > 0 and len(calls) == 5
    # what was timed is the product itself
    torch.testing.assert_close(calls[0](), x @ w.T, rtol=1e-4, atol=1e-4)


def test_model_shape_counts_what_the_hf_model_holds(tmp_path):
    for arch in ("llama", "qwen3"):  # untied head; tied head with its own head_dim
        model = make_model(str(tmp_path / arch), arch)
        shape = roofline.model_shape(str(tmp_path / arch))
        cfg = model.config
        assert shape.layer_params == sum(p.numel() for p in model.model.layers.parameters())
        assert shape.head_params == model.lm_head.weight.numel()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert shape.q_width == cfg.num_attention_heads * head_dim
        assert shape.kv_width == cfg.num_key_value_heads * head_dim
        assert shape.layers == cfg.num_hidden_layers
        assert shape.routed_params == 0 and shape.pass_params(64) == shape.pass_params(1)


def test_model_shape_counts_a_mixture_of_experts_routed_weights(tmp_path):
    model = make_model(str(tmp_path / "moe"), "qwen3_moe")
    shape = roofline.model_shape(str(tmp_path / "moe"))
    cfg = model.config
    routed = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    every = sum(p.numel() for p in model.model.layers.parameters())
    share = cfg.num_experts_per_tok / cfg.num_experts
    assert routed > 0 and shape.routed_params == routed and shape.routed_share == share
    # a token's FLOPs count its k experts; a pass of many tokens reads every expert
    assert shape.layer_params == pytest.approx(every - routed * (1 - share), abs=8)
    assert shape.pass_params(1) == pytest.approx(shape.layer_params + shape.head_params)
    assert shape.pass_params(10_000) == pytest.approx(every + shape.head_params, abs=8)


def _weights(shape, tokens) -> float:
    """Bytes a pass over `tokens` tokens reads: each routed expert unread with probability
    (1 - k/E) per token, token after token; the rest of the model whole."""
    unread = 1.0
    for _ in range(tokens):
        unread *= 1.0 - shape.routed_share
    dense = shape.layer_params - shape.routed_params * shape.routed_share
    return (dense + shape.routed_params * (1.0 - unread) + shape.head_params) * 4


def _counted(shape, rate, bandwidth, passes) -> tuple[float, float, float]:
    """Each pass (list of (new tokens, tokens already cached, samples?) per sequence) costed
    token by token and key by key: (seconds, FLOPs, K/V bytes) over all of them."""
    seconds = total_flops = kv_bytes = 0.0
    for seqs in passes:
        flops, kv_read = 0.0, 0.0
        for new, cached, samples in seqs:
            for t in range(new):
                keys = cached + t + 1
                flops += 2 * shape.layer_params + keys * 4 * shape.q_width * shape.layers
            flops += 2 * shape.head_params if samples else 0
            kv = cached + new if cached else new  # decode reads its context; a prompt writes
            kv_read += kv * 2 * shape.kv_width * shape.layers * 4
        weights = _weights(shape, sum(new for new, _, _ in seqs))
        seconds += max(flops / (rate * 1e9), (weights + kv_read) / (bandwidth * 1e9))
        total_flops += flops
        kv_bytes += kv_read
    return seconds, total_flops, kv_bytes


def _waves(requests, at_once, input_len, output_len):
    passes = []
    for start in range(0, requests, at_once):
        rows = min(at_once, requests - start)
        passes.append([(input_len, 0, True)] * rows)
        passes += [[(1, input_len + i - 1, True)] * rows for i in range(1, output_len)]
    return passes


DENSE = roofline.Shape(layer_params=1_000_000, head_params=300_000, layers=4, q_width=64,
                       kv_width=32)
# 8 experts of 2 active, 1.6 M parameters in all of them: a token runs 400 k of them
MOE = roofline.Shape(layer_params=1_000_000, head_params=300_000, layers=4, q_width=64,
                     kv_width=32, routed_params=1_600_000, routed_share=0.25)


def test_a_mixture_of_experts_pass_reads_the_experts_its_tokens_pick():
    assert MOE.pass_params(1) == 1_000_000 + 300_000  # one token: its 2 experts
    assert MOE.pass_params(2) == pytest.approx(_weights(MOE, 2) / 4)  # 1 - 0.75^2 of them
    assert MOE.pass_params(4096) == pytest.approx(1_000_000 - 400_000 + 1_600_000 + 300_000)
    assert DENSE.pass_params(1) == DENSE.pass_params(4096) == 1_300_000


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("rate, bandwidth", [(200.0, 30.0), (200.0, 0.5), (1.0, 1000.0)])
def test_workload_ceilings_equal_a_token_by_token_count(rate, bandwidth, shape):
    args = dict(num_prompts=6, input_len=10, output_len=5, w2_output_len=7, w3_requests=7,
                w3_concurrency=3)
    got = roofline.ceilings(shape, rate, bandwidth, **args)
    w1 = _counted(shape, rate, bandwidth, _waves(6, 6, 10, 5))[0]
    assert got["w1"]["out_tps"] == pytest.approx(6 * 5 / w1, abs=0.06)
    w2 = _waves(1, 1, 10, 7)
    assert got["w2"]["ttft_s"] == pytest.approx(_counted(shape, rate, bandwidth, w2[:1])[0],
                                                abs=1e-4)
    decode = _counted(shape, rate, bandwidth, w2[1:])[0]
    assert got["w2"]["decode_tps"] == pytest.approx(6 / decode, abs=0.06)
    w3, flops, kv_bytes = _counted(shape, rate, bandwidth, _waves(7, 3, 10, 5))  # 3, 3, 1
    assert got["w3"]["out_tps"] == pytest.approx(7 * 5 / w3, abs=0.06)
    # any schedule: all FLOPs at the rate, or 12 passes' weights (7 x 5 passes of requests, at
    # most 3 in flight) and every K/V byte at the bandwidth, whichever is longer
    weights = _weights(shape, 3)  # (a mixture of experts: passes of 3 decode rows)
    any_s = max(flops / (rate * 1e9), (12 * weights + kv_bytes) / (bandwidth * 1e9))
    assert got["w3"]["any_schedule_out_tps"] == pytest.approx(7 * 5 / any_s, abs=0.06)
    assert got["w3"]["any_schedule_out_tps"] >= got["w3"]["out_tps"]


def test_ceiling_line_gives_each_engines_share():
    ceil = {"gflops": 200.0, "bandwidth_gbs": 30.0,
            "w3": {"out_tps": 200.0, "any_schedule_out_tps": 250.0}}
    cells = {"tokenmill": {"workload": "w3", "out_tps": 150.0},
             "vllm": {"workload": "w3", "out_tps": 100.0},
             "_ratio_to_best_peer": {"peer": "vllm", "ratio": 1.5}}
    line = compare._ceiling_line(ceil, "w3", cells)
    assert "200.0 out tok/s in waves (250.0 any schedule)" in line
    assert line.endswith("tokenmill 75 %, vllm 50 %")


def test_fma_peak_counts_the_fmas_it_ran():
    import ctypes

    lib = roofline.peaks_library()
    if lib is None:
        pytest.skip("no C compiler")
    sink, rounds, chains = ctypes.c_float(), 1000, 12
    flops = lib.tm_fma_flops(rounds, ctypes.byref(sink))
    lanes = flops / (2 * chains * rounds)  # vector lanes x threads that it says it ran
    # each chain x -> 0.9999 x + 1e-4 from 1 + 0.01 j, summed over chains and those lanes
    want = 0.0
    for j in range(chains):
        x = 1.0 + 0.01 * j
        for _ in range(rounds):
            x = x * 0.9999 + 1e-4
        want += x
    assert lanes == int(lanes) and lanes % 8 == 0
    assert sink.value == pytest.approx(lanes * want, rel=1e-4)
    assert roofline.fma_peak_gflops() > 0


def test_compare_rates_the_ceilings_at_the_fma_peak_when_it_has_one(tmp_path):
    make_model(str(tmp_path), "llama")
    args = SimpleNamespace(num_prompts=4, input_len=16, output_len=8, w2_output_len=8,
                           w3_requests=8, w3_concurrency=4)
    roof = {"fma_peak_gflops": 300.0, "matmul_gflops": 100.0, "tokenmill_matmul_gflops": 150.0,
            "bandwidth_gbs": 20.0}
    for peak, rate, after, bandwidth in ((300.0, 300.0, None, 20.0), (None, 150.0, 25.0, 25.0),
                                         (300.0, 300.0, 15.0, 20.0)):
        got = compare.workload_ceilings(str(tmp_path), {**roof, "fma_peak_gflops": peak,
                                                        "bandwidth_after_gbs": after}, args)
        want = roofline.ceilings(roofline.model_shape(str(tmp_path)), rate, bandwidth,
                                 **vars(args))
        assert got == {"gflops": rate, "bandwidth_gbs": bandwidth, **want}


def test_read_kernel_sums_every_element():
    lib = roofline.peaks_library()
    if lib is None:
        pytest.skip("no C compiler")
    x = torch.rand(128 * 1000, dtype=torch.float64).float()
    assert lib.tm_read_sum(x.data_ptr(), x.numel()) == pytest.approx(x.double().sum().item(),
                                                                     rel=1e-5)
    assert roofline.read_gbs(x) > 0


def test_no_engine_starts_its_timed_run_with_a_prompt_already_computed():
    """The warm-ups never use a measured prompt, and both servers run without prefix caching
    (a cached warm-up prompt once made tokenmill's W2 TTFT 4x faster than its FLOPs allow)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "peers"))
    import runner

    measured = {tuple(p) for p in runner.make_prompts(32, 128, 49152)}
    assert not measured & {tuple(p) for p in runner.warmup_prompts(2, 128, 49152)}
    args = SimpleNamespace(input_len=128, output_len=64)
    for engine in ("tokenmill", "vllm"):
        assert "--no-enable-prefix-caching" in compare.server_command(engine, "m", 1, args, "/d")


def test_second_turn_extends_the_first_and_the_warm_up_shares_no_prefix():
    """W4: turn 2 is turn 1's prompt + its answer + new tokens (what a prefix cache can
    reuse); the warm-up shares no first token with it, so nothing is cached before turn 1."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "peers"))
    import runner

    calls = []

    def generate(prompt, n):
        calls.append((list(prompt), n))
        return [7] * n

    result = runner.measure_turns(generate, 1000, SimpleNamespace(input_len=300, output_len=5))
    (warm, _), (first, one), (again, n), (second, last) = calls
    assert one == last == 1 and n == 5 and again == first and len(first) == 300
    assert second[:300] == first and second[300:305] == [7] * 5 and len(second) == 300 + 5 + 128
    assert warm[0] != first[0]
    assert result["ttft"] > 0 and result["turn2_ttft"] > 0


def test_long_context_table_has_a_row_per_length_and_the_turns():
    import long_context

    runs = [{"engine": "tokenmill", "workload": "w2", "input_len": 4000, "ttft": 1.5,
             "decode_tps": 20.0},
            {"engine": "vllm", "workload": "w2", "input_len": 4000, "error": "exit 1"},
            {"engine": "tokenmill", "workload": "w4", "input_len": 16000, "ttft": 30.0,
             "turn2_ttft": 0.5}]
    text = long_context.table({"engines": ["tokenmill", "vllm"], "lengths": [4000],
                               "prefix_len": 16000, "runs": runs})
    assert "| 4000 tokens: TTFT / decode | 1.50 s / 20.0 tok/s | failed |" in text
    assert "16000-token prefix: TTFT cold / cached | 30.00 s / 0.50 s | – |" in text


@pytest.mark.skipif(not __import__("tokenmill").csrc.available(),
                    reason="no compiled CPU kernels")
def test_prompt_attention_bench_times_a_source_against_the_loaded_kernel(tmp_path, monkeypatch):
    # --against the very source the loaded library was built from: the same outputs, both
    # timed, the result file written with its rows
    import json

    import prompt_attention_cpu

    from tokenmill.csrc import build

    source = os.path.join(os.path.dirname(build.__file__), "prompt_attention.c")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["prompt_attention_cpu.py", "--shapes", "40:70,17:0",
                                      "--heads", "9:3:64", "--repeats", "1", "--against",
                                      source, "--out", str(out)])
    prompt_attention_cpu.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["query_tokens"], r["context"]) for r in rows] == [(40, 70), (17, 0)]
    for row in rows:
        assert row["max_abs_difference"] == 0.0
        assert row["current"]["gflops"] > 0 and row["against"]["gflops"] > 0


def test_lora_bench_runs_every_configuration(tiny_models, tmp_path, monkeypatch):
    # the tiny model, two adapter counts: every configuration measured, ratios to the base
    import json

    import lora

    out = tmp_path / "lora.json"
    monkeypatch.setattr(sys, "argv", ["lora.py", "--model", tiny_models("llama")[0],
                                      "--requests", "4", "--prompt-len", "6", "--output-len",
                                      "3", "--rank", "8", "--adapters", "1,2", "--rounds", "1",
                                      "--out", str(out)])
    lora.main()
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["base", "enable-lora, base requests", "1 adapters", "2 adapters"]
    assert results["base"]["ratio"] == 1.0
    assert all(r["tok_s"] > 0 for r in results.values())
