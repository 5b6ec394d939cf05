"""Sleep mode and weight updates offline (engine/sleep_mode.py): level 1 drops the KV cache
and keeps the weights, level 2 drops both (checked by the tensors being gone, not by timing
or RSS); after waking, outputs equal a fresh engine's (greedy and seeded); a weight update
serves another checkpoint exactly as a fresh engine over it does, refuses one of another
shape or none, and keeps the old weights serving when the new ones fail to load; every
refusal names what to do."""

import gc
import os
import shutil
import weakref

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.engine.protocol import EngineCoreRequest

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 45)), [300, 2, 77]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=30, seed=11, max_tokens=8, ignore_eos=True)


def _tokens(llm, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _perturbed(path: str, to: str, seed: int = 3):
    """A copy of the checkpoint at `path` with other weights of the same shapes; its HF
    model."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(path, to)
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g))
    model.save_pretrained(to)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_sleep_frees_and_wake_up_restores(tiny_models, arch):
    path, _ = tiny_models(arch)
    with LLM(path, kv_cache_memory_gib=0.01, enable_sleep_mode=True) as llm:
        greedy, seeded = _tokens(llm), _tokens(llm, SEEDED)
        runner = llm.engine.core.runner
        layers = runner._layers or list(runner.model.modules())
        cache = weakref.ref(next(t for t in (getattr(m, "k_cache", None) for m in layers)
                                 if t is not None and t.numel()))
        weight = weakref.ref(runner.model.model.embed_tokens.weight)
        decode_step = runner.decode_step is not None
        llm.sleep(1)
        gc.collect()
        assert llm.is_sleeping() and cache() is None and weight() is not None
        with pytest.raises(ValueError, match="sleeping: wake it up first"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
        llm.sleep(1)  # (asleep already: nothing to do)
        llm.wake_up()
        assert not llm.is_sleeping() and (runner.decode_step is not None) == decode_step
        assert _tokens(llm) == greedy and _tokens(llm, SEEDED) == seeded
        llm.sleep(2)
        gc.collect()
        assert weight() is None and runner.model is None
        llm.wake_up()
        assert _tokens(llm) == greedy and _tokens(llm, SEEDED) == seeded
        kv = llm.engine.core.kv_cache
        assert kv.pool.num_free_blocks == kv.num_blocks


def test_weight_update_serves_the_new_checkpoint_as_a_fresh_engine(tiny_models, tmp_path):
    path, hf = tiny_models("llama")
    other = str(tmp_path / "other")
    hf_other = _perturbed(path, other)
    with LLM(other, kv_cache_memory_gib=0.01) as fresh:
        want_greedy, want_seeded = _tokens(fresh), _tokens(fresh, SEEDED)
    assert want_greedy == [hf_greedy(hf_other, p, 8) for p in PROMPTS]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:  # (no sleep mode needed)
        before = _tokens(llm)
        assert before == [hf_greedy(hf, p, 8) for p in PROMPTS] != want_greedy
        _tokens(llm)
        hits = llm.engine.core.kv_cache.num_hit_tokens
        assert hits > 0  # (the second time the prompts' blocks were cached)
        llm.update_weights_from_disk(other)
        assert _tokens(llm) == want_greedy  # (no hit on the old weights' blocks)
        assert llm.engine.core.kv_cache.num_hit_tokens == hits
        assert _tokens(llm, SEEDED) == want_seeded
        # a checkpoint of another shape, none at all, or weights that fail to load: refused,
        # the weights served before still serve
        wide = str(tmp_path / "wide")
        shutil.copytree(path, wide)
        with open(os.path.join(wide, "config.json")) as f:
            text = f.read().replace('"hidden_size": 64', '"hidden_size": 96')
        with open(os.path.join(wide, "config.json"), "w") as f:
            f.write(text)
        broken = str(tmp_path / "broken")
        shutil.copytree(path, broken)
        with open(os.path.join(broken, "model.safetensors"), "r+b") as f:
            f.truncate(1000)
        for bad, fragment in ((wide, "hidden_size is 96, the served model's 64"),
                              (str(tmp_path / "none"), "No checkpoint to update the weights"),
                              (broken, "could not be loaded")):
            with pytest.raises(ValueError, match=fragment):
                llm.update_weights_from_disk(bad)
            assert _tokens(llm) == want_greedy
        assert not llm.is_sleeping()


def test_a_model_that_no_longer_loads_stays_asleep(tiny_models, tmp_path):
    path = str(tmp_path / "m")
    shutil.copytree(tiny_models("llama")[0], path)
    with LLM(path, kv_cache_memory_gib=0.01, enable_sleep_mode=True) as llm:
        before = _tokens(llm)
        llm.sleep(2)
        weights = os.path.join(path, "model.safetensors")
        os.rename(weights, weights + ".away")
        with pytest.raises(ValueError, match="Waking up failed: the model did not load"):
            llm.wake_up()
        assert llm.is_sleeping()
        os.rename(weights + ".away", weights)
        llm.wake_up()
        assert _tokens(llm) == before


def test_refusals_name_what_to_do(tiny_models):
    path, _ = tiny_models("llama")
    with LLM(path, kv_cache_memory_gib=0.01) as llm, pytest.raises(
            ValueError, match="--enable-sleep-mode"):
        llm.sleep(1)
    with LLM(path, kv_cache_memory_gib=0.01, enable_sleep_mode=True) as llm:
        with pytest.raises(ValueError, match="must be 1 or 2"):
            llm.sleep(3)
        core = llm.engine.core
        core.add_request(EngineCoreRequest("busy", PROMPTS[1], GREEDY))
        for act in (lambda: llm.sleep(1), lambda: llm.update_weights_from_disk(path)):
            with pytest.raises(ValueError, match="needs an idle engine: 1 request"):
                act()
        while core.has_unfinished_requests():  # (bounded: 8 tokens)
            core.step()
        llm.sleep(2)
        llm.wake_up()
    with LLM(path, kv_cache_memory_gib=0.01, enable_sleep_mode=True,
             enable_lora=True) as llm:
        llm.sleep(1)  # (level 1 keeps the weights the adapters wrap)
        llm.wake_up()
        with pytest.raises(ValueError, match="not built beside LoRA adapters"):
            llm.sleep(2)
    with pytest.raises(ValueError, match="not built for tensor or pipeline parallel"):
        LLM(path, enable_sleep_mode=True, tensor_parallel_size=2)


def _trainer(model, port: int, ready, order=None):
    """A trainer's rank 0: hosts the group's store, joins, then broadcasts the model's
    tensors (in `order`, default its state dict's). Returns its thread."""
    import datetime
    import threading

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    tensors = model.state_dict()

    def run():
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=60)
        group = dist.ProcessGroupGloo(store, 0, 2, opts)
        ready.wait(60)
        for name in order or tensors:
            group.broadcast(tensors[name].contiguous(), 0).wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, tensors


def test_weights_from_a_trainer_over_a_gloo_group(tiny_models, tmp_path):
    """The trainer broadcasts every tensor (SGLang's calls, vLLM's pattern): served as a
    fresh engine over them serves; a second sync replaces the first's staged folder."""
    import threading

    from tests.serving import free_port

    path, _ = tiny_models("llama")
    hf_other = _perturbed(path, str(tmp_path / "other"))
    with LLM(str(tmp_path / "other"), kv_cache_memory_gib=0.01) as fresh:
        want = _tokens(fresh)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        with pytest.raises(ValueError, match="init_weights_update_group first"):
            llm.update_weights_from_distributed(["x"], ["float32"], [[1]])
        port, ready = free_port(), threading.Event()
        thread, tensors = _trainer(hf_other, port, ready)
        llm.init_weights_update_group("127.0.0.1", port, 1, 2)
        names = list(tensors)
        ready.set()
        llm.update_weights_from_distributed(names, [t.dtype for t in tensors.values()],
                                            [t.shape for t in tensors.values()])
        thread.join(60)
        staged = llm.engine.core.weight_staging
        assert os.path.isdir(staged) and _tokens(llm) == want
        with pytest.raises(ValueError, match="dtype must be one of"):
            llm.update_weights_from_distributed(names[:1], ["int64"], [[2]])
        with pytest.raises(ValueError, match="more than the"):
            llm.update_weights_from_distributed(names[:1], ["float32"], [[1 << 20, 1 << 10]])
        # a sync that leaves tensors out: refused naming them, the last weights serve
        port, ready = free_port(), threading.Event()
        thread, _ = _trainer(hf_other, port, ready, order=names[:-1])
        llm.init_weights_update_group("127.0.0.1", port, 1, 2)
        ready.set()
        with pytest.raises(ValueError, match=f"lacks weights for: {names[-1]}"):
            llm.update_weights_from_distributed(
                names[:-1], [tensors[n].dtype for n in names[:-1]],
                [tensors[n].shape for n in names[:-1]])
        thread.join(60)
        assert _tokens(llm) == want and llm.engine.core.weight_staging == staged
        llm.destroy_weights_update_group()
    assert not os.path.exists(staged)  # (removed with the engine)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:  # (or by a later update from disk)
        port, ready = free_port(), threading.Event()
        thread, _ = _trainer(hf_other, port, ready)
        llm.init_weights_update_group("127.0.0.1", port, 1, 2)
        ready.set()
        llm.update_weights_from_distributed(names, [t.dtype for t in tensors.values()],
                                            [t.shape for t in tensors.values()])
        thread.join(60)
        staged = llm.engine.core.weight_staging
        llm.update_weights_from_disk(path)
        assert not os.path.exists(staged) and llm.engine.core.weight_staging is None
