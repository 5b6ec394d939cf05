"""EAGLE-3 heads (method "eagle3") on a 6-layer tiny Llama target with a random head in
EAGLE-3's checkpoint layout (midlayer, fc over three target layers' hidden states, its own
norm and LM head over a smaller draft vocabulary mapped by d2t): each step's drafts equal
the head run from scratch with transformers' attention and MLP over the whole context;
greedy outputs identical to decoding without speculation; heads that do not fit are
start-up errors."""

import json
import os

import pytest
import torch
from helpers import make_model
from safetensors.torch import save_file

from tests.spec_decode.test_spec_decode_eagle import check_head
from tokenmill import LLM

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 40)), [7, 8, 9, 7, 8, 9, 7]]
AUX = (2, 3, 3)  # EAGLE-3's default for 6 layers: 2, L / 2, L - 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eagle3") / "llama6")
    return path, make_model(path, "llama", num_hidden_layers=6)


def make_eagle3(target_path: str, out: str, draft_vocab: int = 300, d2t: bool = True) -> dict:
    with open(os.path.join(target_path, "config.json")) as f:
        config = {**json.load(f), "num_hidden_layers": 1, "draft_vocab_size": draft_vocab}
    config.pop("layer_types", None)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = hidden // heads
    g = torch.Generator().manual_seed(7)

    def rand(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    t = {f"midlayer.{n}.weight": 1 + rand(hidden, scale=0.1)
         for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    t.update({"midlayer.self_attn.q_proj.weight": rand(heads * dim, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": rand(kv * dim, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": rand(kv * dim, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": rand(hidden, heads * dim),
              "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
              "midlayer.mlp.up_proj.weight": rand(inter, hidden),
              "midlayer.mlp.down_proj.weight": rand(hidden, inter),
              "fc.weight": rand(hidden, 3 * hidden, scale=0.1),
              "norm.weight": 1 + rand(hidden, scale=0.1),
              "lm_head.weight": rand(draft_vocab, hidden, scale=1.0)})
    vocab = config["vocab_size"]
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    if d2t:
        t["d2t"] = ids - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    os.makedirs(out, exist_ok=True)
    save_file(t, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return {**t, "ids": ids}


def reference_drafts(hf, t, context, k):
    """From scratch: rows (embedding of token i + 1, fc(target hidden states entering layers
    AUX at i)) for i < N - 1, attention over [norm(embedding), norm(hidden)] with the hidden
    as residual, the MLP, the head's norm and LM head mapped into the target's vocabulary;
    then one row per draft fed the draft and the last row's output before the norm."""
    from transformers.models.llama import modeling_llama as ml

    config, eps = hf.config, hf.config.rms_norm_eps
    hidden = config.hidden_size
    attn = ml.LlamaAttention(config, 0).eval()
    for name in ("q_proj", "k_proj", "v_proj"):
        w = t[f"midlayer.self_attn.{name}.weight"]
        setattr(attn, name, torch.nn.Linear(2 * hidden, w.shape[0], bias=False))
        getattr(attn, name).weight.data.copy_(w)
    attn.o_proj.weight.data.copy_(t["midlayer.self_attn.o_proj.weight"])
    mlp = ml.LlamaMLP(config).eval()
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight.data.copy_(t[f"midlayer.mlp.{name}.weight"])
    rotary = ml.LlamaRotaryEmbedding(config)
    emb = hf.model.embed_tokens.weight

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * t[name]

    def layer(embeds, states):
        x = torch.cat([rms(embeds, "midlayer.input_layernorm.weight"),
                       rms(states, "midlayer.hidden_norm.weight")], -1)[None]
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out, _ = attn(x, position_embeddings=rotary(x, torch.arange(n)[None]),
                      attention_mask=mask)
        h = out[0] + states
        return mlp(rms(h, "midlayer.post_attention_layernorm.weight")) + h

    with torch.no_grad():
        ids = torch.tensor(context)
        states = hf.model(ids[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0] for i in AUX], -1) @ t["fc.weight"].T
        embeds, rows, drafts = emb[ids[1:]], features[:-1], []
        for _ in range(k):
            summed = layer(embeds, rows)
            scores = rms(summed[-1], "norm.weight") @ t["lm_head.weight"].T
            drafts.append(int(t["ids"][int(scores.argmax())]))
            embeds = torch.cat([embeds, emb[drafts[-1]][None]])
            rows = torch.cat([rows, summed[-1][None]])
    return drafts


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (1, 3), (2, 2)])
def test_eagle3_drafts_and_outputs(target, tmp_path, tp, pp):
    """pp 2: the head's layers on both stages; pp 3: a middle stage's states carried on;
    tp 2 x pp 2: stage 0's other rank drafts with the states by layer too."""
    path, hf = target
    head = str(tmp_path / "eagle3")
    tensors = make_eagle3(path, head)
    # (the reference maps every draft through d2t: drafts are draft-vocabulary tokens)
    check_head(path, {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                      "disable_by_batch_size": 8},
               lambda context, k: reference_drafts(hf, tensors, context, k), tp, pp)


def test_bad_eagle3_heads_are_start_up_errors(target, tiny_models, tmp_path):
    path, _ = target
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    unmapped = str(tmp_path / "unmapped")
    make_eagle3(path, unmapped, d2t=False)
    with pytest.raises(ValueError, match="no d2t mapping"):
        LLM(path, speculative_config={**spec, "model": unmapped})
    shallow = tiny_models("llama")[0]  # 2 layers: EAGLE-3's default layers 2, 1, -1
    head = str(tmp_path / "head")
    make_eagle3(shallow, head)
    with pytest.raises(ValueError, match="reads the target's layers"):
        LLM(shallow, speculative_config={**spec, "model": head})


def test_eagle3_in_cuda_graph_buckets(target, tmp_path, monkeypatch):
    """The target's steps run in the CUDA-graph buckets beside an EAGLE-3 head too (eagerly
    here, as captured on a GPU): a bucket gives the hidden states entering the head's target
    layers, which its first pass reads, and the head's passes run in buckets of their own.
    Drafts equal the reference at every step, also with 1 or 2 accepted by fiat; greedy
    outputs equal decoding without speculation."""
    from helpers import accept_by_fiat, check_drafts_each_step, record_replays

    from tokenmill import SamplingParams
    from tokenmill.engine.protocol import EngineCoreRequest
    from tokenmill.sample import rejection_sampler as rejection

    path, hf = target
    head = str(tmp_path / "eagle3")
    tensors = make_eagle3(path, head)
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
            "disable_by_batch_size": 4}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = {"kv_cache_memory_gib": 0.02, "attention_backend": "triton", "max_num_seqs": 4}
    with LLM(path, **engine, enforce_eager=True) as llm:
        base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    with LLM(path, **engine, enable_prefix_caching=False, speculative_config=spec) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs.widths == {1: [1, 2, 4], 4: [1, 2, 4]}
        assert runner.graphs.aux.ids == (2, 3) and runner.heads.graphs is not None
        assert runner.pieces.aux.ids == (2, 3)  # (prompt steps: the head's first pass reads them)
        replays = []
        record_replays(monkeypatch, {"target": runner.graphs,
                                     "first": runner.heads.graphs.first}, replays)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert {("target", 4, 4), ("first", 4, 4)} <= set(replays)
        monkeypatch.setattr(rejection, "verify_greedy", accept_by_fiat)
        core = llm.engine.core
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(f"fiat{i}", prompt, params))
        checked = check_drafts_each_step(
            core, lambda context, k: reference_drafts(hf, tensors, context, k), 3)
        assert checked >= 4 and core.scheduler.num_accepted_tokens >= 4
