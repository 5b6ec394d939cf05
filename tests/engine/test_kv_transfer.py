"""Prefill/decode disaggregation in the engine (--kv-transfer-config, NIXL over UCX on this
machine): a decode engine that reads a prompt's KV blocks from a prefill engine answers
token for token as one engine, computing only the prompt's last partial block; the prefill
engine keeps the blocks until the read notifies it; parameters that are not this
deployment's are refused with a 400, a prefill peer that is gone or released its blocks with
a 503; a prompt that differs from the one prefilled is computed instead."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import require_nixl

from tokenmill import LLM, SamplingParams
from tokenmill.config.engine import EngineConfig
from tokenmill.config.kv_transfer import KVTransferConfig, check_params

require_nixl()

PROMPT = [(i * 7) % 400 + 3 for i in range(200)]  # (12 full blocks of 16 and 8 tokens)
GREEDY = dict(temperature=0, ignore_eos=True)
CONFIG = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def engine(path, **extra):
    return LLM(path, kv_cache_memory_gib=0.02, max_model_len=512,
               kv_transfer_config=extra.pop("config", CONFIG), **extra)


def generate(llm, prompt, **params):
    return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params),
                        use_tqdm=False)[0]


def prefill(llm, prompt=PROMPT):
    out = generate(llm, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                   **GREEDY)
    return out.kv_transfer_params


def decode(llm, params, prompt=PROMPT, max_tokens=12):
    return generate(llm, prompt, max_tokens=max_tokens, kv_transfer_params=params, **GREEDY)


@pytest.fixture(scope="module")
def engines(tiny_models):
    path = tiny_models("llama")[0]
    with LLM(path, kv_cache_memory_gib=0.02, max_model_len=512) as one:
        baseline = list(generate(one, PROMPT, max_tokens=12, **GREEDY).outputs[0].token_ids)
    with engine(path) as p, engine(path) as d:
        yield p, d, baseline


def test_decode_reads_the_prompt_and_matches_one_engine(engines):
    p, d, baseline = engines
    params = prefill(p)
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 12
    transfer = p.engine.core.kv_transfer
    assert transfer.num_held_blocks == 12  # (kept for the decode side)
    out = decode(d, params)
    assert list(out.outputs[0].token_ids) == baseline
    assert out.num_cached_tokens == 192  # (12 blocks read; the last 8 tokens computed)
    assert d.engine.core.kv_transfer.num_read_blocks == 12
    # the read's notification lets the prefill side's blocks go at its next step
    generate(p, [5, 6, 7], max_tokens=1)
    assert transfer.num_held_blocks == 0 and not transfer.held
    p.engine.core.kv_cache.pool.check_integrity()
    d.engine.core.kv_cache.pool.check_integrity()


def test_a_cached_prompt_reads_nothing_and_still_releases(engines):
    p, d, baseline = engines
    decode(d, prefill(p))  # (d's prefix cache holds the prompt's blocks now)
    read = d.engine.core.kv_transfer.num_read_blocks
    params = prefill(p)
    out = decode(d, params)
    assert list(out.outputs[0].token_ids) == baseline
    assert d.engine.core.kv_transfer.num_read_blocks == read
    generate(p, [5, 6, 7], max_tokens=1)
    assert not p.engine.core.kv_transfer.held


def test_another_prompt_is_computed_not_read(engines):
    p, d, _ = engines
    params = prefill(p)
    other = PROMPT[:150] + [9] * 50
    with LLM(d.engine.core.model_config.path, kv_cache_memory_gib=0.02,
             max_model_len=512) as one:
        expected = list(generate(one, other, max_tokens=6, **GREEDY).outputs[0].token_ids)
    read = d.engine.core.kv_transfer.num_read_blocks
    d.engine.core.kv_cache.reset_prefix_cache()
    out = decode(d, params, prompt=other, max_tokens=6)
    assert list(out.outputs[0].token_ids) == expected
    assert d.engine.core.kv_transfer.num_read_blocks == read


def test_a_hold_that_runs_out_lets_its_blocks_go(engines):
    p, _, _ = engines
    params = prefill(p)
    transfer, pool = p.engine.core.kv_transfer, p.engine.core.kv_cache.pool
    transfer_id = params["remote_request_id"]
    blocks, _ = transfer.held[transfer_id]
    refs = [b.ref_cnt for b in blocks]
    transfer.held[transfer_id] = (blocks, 0.0)  # (its hold_seconds passed)
    generate(p, [5, 6, 7], max_tokens=1)  # (a step: where holds are looked at)
    assert transfer_id not in transfer.held
    assert [b.ref_cnt for b in blocks] == [r - 1 for r in refs]
    pool.check_integrity()


def test_a_read_that_does_not_finish_times_out(tiny_models, monkeypatch):
    path = tiny_models("llama")[0]
    config = ('{"kv_connector":"NixlConnector",'
              '"kv_connector_extra_config":{"timeout_seconds":1}}')
    with engine(path) as p, engine(path, config=config) as d:
        params = prefill(p)
        transfer = d.engine.core.kv_transfer
        monkeypatch.setattr(transfer.agent, "check_xfer_state", lambda handle: "PROC")
        with pytest.raises(ValueError, match="timed out") as info:
            decode(d, params)
        assert info.value.status == 503 and transfer.num_failed == 1
        pool = d.engine.core.kv_cache.pool
        pool.check_integrity()
        assert pool.num_used_blocks == 0 and not transfer.reads


def test_a_request_aborted_while_read_is_forgotten(tiny_models, monkeypatch):
    path = tiny_models("llama")[0]
    with engine(path) as p, engine(path) as d:
        params = prefill(p)
        transfer = d.engine.core.kv_transfer
        monkeypatch.setattr(transfer.agent, "check_xfer_state", lambda handle: "PROC")
        request_id = d.engine.add_request(None, {"prompt_token_ids": PROMPT}, SamplingParams(
            max_tokens=4, kv_transfer_params=params, **GREEDY))
        assert request_id in transfer.reads
        d.engine.abort_request([request_id])
        monkeypatch.undo()  # (the read finishes now)
        for _ in range(10_000):
            if not d.engine.has_unfinished_requests():
                break
            assert not d.engine.step()  # (no output for the aborted request)
        assert not transfer.reads and transfer.num_read_blocks == 12
        pool = d.engine.core.kv_cache.pool
        pool.check_integrity()
        assert pool.num_used_blocks == 0
        # (the blocks it read stay in the prefix cache: the next decode reads nothing)
        assert decode(d, prefill(p)).num_cached_tokens == 192
        assert transfer.num_read_blocks == 12


def test_a_data_parallel_decode_engine(engines, tiny_models):
    """Each replica (an engine-core process) runs its own agent and reads for its requests."""
    p, _, baseline = engines
    with engine(tiny_models("llama")[0], data_parallel_size=2) as d:
        for prompt_params in (prefill(p), prefill(p)):
            out = decode(d, prompt_params)
            assert list(out.outputs[0].token_ids) == baseline and out.num_cached_tokens == 192


def test_refusals_name_the_problem(engines):
    p, d, _ = engines
    params = prefill(p)
    for change, status, words in (
            ({"kv_layout": "0" * 32}, 400, "another model"),
            ({"expires_at": time.time() + 1}, 503, "released"),
            ({"remote_engine_id": "someone-else"}, 400, "does not match")):
        with pytest.raises(ValueError, match=words) as info:
            decode(d, {**params, **change})
        assert getattr(info.value, "status", 400) == status
    # (the real peer stays connected: its next parameters are read as before)
    other, read = PROMPT[:100] + [7] * 100, d.engine.core.kv_transfer.num_read_blocks
    assert decode(d, prefill(p, other), prompt=other).num_cached_tokens == 192
    assert d.engine.core.kv_transfer.num_read_blocks > read
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True})
    with LLM(d.engine.core.model_config.path, kv_cache_memory_gib=0.02,
             max_model_len=512) as plain, pytest.raises(ValueError, match="kv_transfer_config"):
        decode(plain, params)
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    d.engine.core.kv_cache.pool.check_integrity()


PREFILL_PROCESS = """
import json, sys
from tokenmill import LLM, SamplingParams
with LLM(sys.argv[1], kv_cache_memory_gib=0.02, max_model_len=512,
         kv_transfer_config=sys.argv[2]) as llm:
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[3])}],
                       SamplingParams(max_tokens=1, temperature=0,
                                      kv_transfer_params={"do_remote_decode": True}),
                       use_tqdm=False)[0]
print(json.dumps(out.kv_transfer_params))
"""


def test_a_gone_prefill_instance_fails_the_request_cleanly(tiny_models):
    """The prefill instance's process ends after answering: the read finds no peer."""
    path = tiny_models("llama")[0]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run([sys.executable, "-c", PREFILL_PROCESS, path, CONFIG,
                            json.dumps(PROMPT)], capture_output=True, text=True, timeout=300,
                           cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert child.returncode == 0, child.stderr[-2000:]
    params = json.loads(child.stdout.strip().splitlines()[-1])
    with engine(path) as d:
        with pytest.raises(ValueError, match="prefill instance") as info:
            decode(d, params)
        assert info.value.status == 503
        d.engine.core.kv_cache.pool.check_integrity()
        assert d.engine.core.kv_cache.pool.num_used_blocks == 0
        assert generate(d, PROMPT[:20], max_tokens=2).outputs[0].token_ids  # (still serving)


def test_signed_parameters(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    secret = tmp_path / "secret"
    secret.write_text("a shared secret of this deployment")
    config = ('{"kv_connector":"NixlConnector","kv_connector_extra_config":'
              f'{{"secret_file":"{secret}"}}}}')
    with engine(path, config=config) as p, engine(path, config=config) as d:
        params = prefill(p)
        assert params["signature"]
        forged = dict(params, remote_block_ids=params["remote_block_ids"][::-1])
        with pytest.raises(ValueError, match="not signed"):
            decode(d, forged)
        assert decode(d, params).num_cached_tokens == 192


def test_config_is_checked():
    assert KVTransferConfig.parse(CONFIG).kv_role == "kv_both"
    for value, words in (("{", "JSON object"), ('{"kv_connector":"Mooncake"}', "not built"),
                         ('{"kv_role":"both"}', "kv_role"),
                         ('{"kv_connector_extra_config":{"hold_seconds":0}}', "hold_seconds"),
                         ('{"kv_connector_extra_config":{"secret_file":"/nonexistent"}}',
                          "secret_file"), ('{"x":1}', "unknown key")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(kv_transfer_config=value)
    with pytest.raises(ValueError, match="prefix-caching"):
        EngineConfig(kv_transfer_config=CONFIG, enable_prefix_caching=False)
    assert check_params(None) is None and check_params({"do_remote_decode": False}) is None
    with pytest.raises(ValueError, match="remote_block_ids"):
        check_params({"do_remote_prefill": True, **{k: "x" for k in (
            "remote_engine_id", "remote_request_id", "remote_agent_metadata", "kv_layout",
            "last_block_hash")}, "remote_block_ids": [-1]})
