"""EAGLE-1 heads (method "eagle") on the tiny Llama and Qwen2 targets with random heads in
EAGLE's checkpoint layout: each step's drafts equal the head run from scratch with
transformers' decoder layer over the whole context; greedy outputs identical to decoding
without speculation; heads that do not fit the target are start-up errors."""

import json
import os

import pytest
import torch
from helpers import accept_by_fiat, check_drafts_each_step, record_replays
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.engine.protocol import EngineCoreRequest

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 40)), [7, 8, 9, 7, 8, 9, 7]]


def make_eagle(target_path: str, out: str, **overrides) -> dict:
    """A random EAGLE-1 head for the model at `target_path`, saved as EAGLE ships it (fc,
    layers.0 without input_layernorm, a copy of the embedding); returns its tensors."""
    import transformers as tf

    with open(os.path.join(target_path, "config.json")) as f:
        config = {**json.load(f), "num_hidden_layers": 1, **overrides}
    config.pop("layer_types", None)  # (per layer: the target's count)
    hf_config = tf.AutoConfig.for_model(**config)
    torch.manual_seed(5)
    layer = tf.models.llama.modeling_llama.LlamaDecoderLayer(hf_config, 0) \
        if config["model_type"] == "llama" else \
        tf.models.qwen2.modeling_qwen2.Qwen2DecoderLayer(hf_config, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1, 0.1)
    hidden = config["hidden_size"]
    tensors = {f"layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()
               if "input_layernorm" not in k}
    g = torch.Generator().manual_seed(6)
    tensors["fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    tensors["fc.bias"] = 0.1 * torch.randn(hidden, generator=g)
    tensors["embed_tokens.weight"] = torch.zeros(config["vocab_size"], hidden)  # not read
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def reference_drafts(hf, tensors, context, k):
    """The head from scratch: rows fc([embedding of token i + 1, target hidden at i]) for
    i < N - 1 through transformers' layer (no input norm, no final norm), then one row per
    draft fed the draft and the previous row's output."""
    import transformers as tf

    fields = {**hf.config.to_dict(), "num_hidden_layers": 1}
    fields.pop("layer_types", None)
    config = tf.AutoConfig.for_model(**fields)
    model = type(hf.model)(config).eval()
    model.layers[0].input_layernorm = torch.nn.Identity()
    model.norm = torch.nn.Identity()
    model.layers[0].load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items()
                                     if k.startswith("layers.0.")}, strict=False)
    emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight

    def row(token_embeds, previous):
        joined = torch.cat([token_embeds, previous], -1)
        return joined @ tensors["fc.weight"].T + tensors["fc.bias"]

    with torch.no_grad():
        ids = torch.tensor(context)
        hidden = hf.model(ids[None]).last_hidden_state[0]
        rows, drafts = row(emb[ids[1:]], hidden[:-1]), []
        for _ in range(k):
            out = model(inputs_embeds=rows[None],
                        position_ids=torch.arange(len(rows))[None]).last_hidden_state[0]
            drafts.append(int((out[-1] @ head.T).argmax()))
            rows = torch.cat([rows, row(emb[drafts[-1]], out[-1])[None]])
    return drafts


def check_head(path: str, spec: dict, reference, tp: int = 1, pp: int = 1) -> None:
    """A head's drafts at every step (chunked prompts) equal `reference(context, k)`, its
    KV blocks all come back, and greedy outputs under preemption equal decoding without it
    (shared with the EAGLE-3 tests); `tp` x `pp` ranks run the speculating engines (under
    pipeline parallel the head runs on stage 0, over what the last stage sends back)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.02, enable_prefix_caching=False,
             max_num_batched_tokens=11, speculative_config=spec,
             tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        core = llm.engine.core
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        checked = check_drafts_each_step(core, reference, spec["num_speculative_tokens"])
        assert checked >= 6
        assert core.kv_cache.pool.num_free_blocks == core.kv_cache.num_blocks
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, kv_cache_memory_gib=0.02) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, num_kv_blocks=14, block_size=4, speculative_config=spec,
             tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert llm.engine.core.kv_cache.pool.num_free_blocks == 14
    assert outs == base


@pytest.mark.parametrize("arch,tp,pp", [("llama", 1, 1), ("qwen2", 1, 1), ("llama", 2, 1),
                                         ("llama", 1, 2)])
def test_eagle_drafts_and_outputs(tiny_models, tmp_path, arch, tp, pp):
    path, hf = tiny_models(arch)
    eagle = str(tmp_path / "eagle")
    tensors = make_eagle(path, eagle)
    check_head(path, {"method": "eagle", "model": eagle, "num_speculative_tokens": 3,
                      "disable_by_batch_size": 8},
               lambda context, k: reference_drafts(hf, tensors, context, k), tp, pp)


def test_eagle_beside_decode_graphs(tiny_models, tmp_path, monkeypatch):
    """An engine with a head runs its decode steps in the CUDA-graph buckets (run eagerly
    here, the Triton kernels in the interpreter, as captured on a GPU): plain decode steps
    (speculation off above disable_by_batch_size) and steps whose every sequence carries
    its k drafts (3 rows a sequence), whose final hidden states the head reads. The head's
    drafts still equal the reference at every step, and outputs equal transformers' greedy
    tokens."""
    from helpers import hf_greedy

    from tokenmill.sample import rejection_sampler as rejection

    path, hf = tiny_models("llama")
    eagle = str(tmp_path / "eagle")
    tensors = make_eagle(path, eagle)
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    spec = {"method": "eagle", "model": eagle, "num_speculative_tokens": 2,
            "disable_by_batch_size": 2}
    prompts = PROMPTS + [[11, 12, 13, 14]]
    lengths = (12, 9, 4, 3)  # 4 sequences decode in graphs, the last 2 with drafts
    with LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton", max_num_seqs=4,
             enable_prefix_caching=False, speculative_config=spec) as llm:
        graphs = llm.engine.core.runner.graphs
        assert graphs.widths == {1: [1, 2, 4], 3: [1, 2]}
        runs, passes = [], []
        original = graphs.run
        monkeypatch.setattr(graphs, "run", lambda inputs, fill=None: runs.append(
            (len(inputs.starts), inputs.uniform_rows)) or original(inputs, fill))
        head = llm.engine.core.runner.heads.graphs  # the head's passes in graph buckets too
        record_replays(monkeypatch, {"first": head.first, "chain": head.chain[0]}, passes)
        core = llm.engine.core
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True)))
        checked = check_drafts_each_step(
            core, lambda context, k: reference_drafts(hf, tensors, context, k), 2)
        assert checked >= 3 and max(runs) > (2, 1) and (2, 3) in runs
        assert {("first", 4, 1), ("first", 2, 3), ("chain", 2, 1)} <= set(passes)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in lengths], use_tqdm=False)
        # The random head's drafts are all rejected: accept 1 or 2 of them by fiat (the
        # outputs are no longer the target's), so the graphed first pass reads each
        # request's accepted rows among the padded ones. The drafts must still follow.
        monkeypatch.setattr(rejection, "verify_greedy", accept_by_fiat)
        for i, prompt in enumerate(prompts[:2]):
            core.add_request(EngineCoreRequest(f"fiat{i}", prompt, SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True)))
        passes.clear()
        checked = check_drafts_each_step(
            core, lambda context, k: reference_drafts(hf, tensors, context, k), 2)
        assert checked >= 4 and ("first", 2, 3) in passes
        assert core.scheduler.num_accepted_tokens >= 4
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]


def test_bad_eagle_heads_are_start_up_errors(tiny_models, tmp_path):
    path, _ = tiny_models("llama")
    spec = {"method": "eagle", "num_speculative_tokens": 2}
    wide = str(tmp_path / "wide")
    make_eagle(path, wide, hidden_size=128, intermediate_size=256)
    with pytest.raises(ValueError, match="has hidden_size 128, the target 64"):
        LLM(path, speculative_config={**spec, "model": wide})
    bad = str(tmp_path / "bad")
    tensors = make_eagle(path, bad)
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :64].contiguous()},
              os.path.join(bad, "model.safetensors"))
    with pytest.raises(ValueError, match="'fc.weight'.*shape"):
        LLM(path, speculative_config={**spec, "model": bad})
    os.remove(os.path.join(bad, "model.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(path, speculative_config={**spec, "model": bad})
