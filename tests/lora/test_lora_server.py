"""Adapters over the OpenAI API: chosen by `model`, listed by /v1/models with their base as
parent, answered as transformers + peft answer; an unknown name is a 404."""

import concurrent.futures

import openai
import pytest
from helpers import hf_greedy

from tests.serving import service_over_engine
from tokenmill.config.engine import EngineConfig

PROMPTS = [[5, 9, 23, 41, 7, 3], [11, 12, 13]]


@pytest.fixture(scope="module")
def served(tiny_models, adapters):
    path, hf_model = tiny_models("llama")
    a_path, a_ref = adapters("llama", "mix-a", seed=1,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
    b_path, b_ref = adapters("llama", "mix-b", seed=2, r=16,
                             target_modules=["q_proj", "v_proj", "down_proj"])
    lora = {"enable_lora": True, "max_loras": 2,
            "lora_modules": [f"sql={a_path}", f'{{"name": "chat", "path": "{b_path}", '
                                                 '"base_model_name": "tiny-base"}']}
    with service_over_engine(path, engine=lora, engine_config=EngineConfig(
            model=path, **lora)) as thread:
        yield thread, {"tiny": hf_model, "sql": a_ref, "chat": b_ref}


def test_models_lists_adapters(served):
    thread, _ = served
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"].parent is None
    assert cards["sql"].parent == "tiny" and cards["chat"].parent == "tiny-base"


def test_completions_by_adapter(served, tiny_models):
    thread, refs = served
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models("llama")[0])  # (the served tokenizer)
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="x")
    jobs = [(name, p) for p in PROMPTS for name in refs]

    def complete(job):
        name, prompt = job
        out = client.completions.create(model=name, prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.model, out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # (in the same steps)
        got = list(pool.map(complete, jobs))
    expected = [(name, tok.decode(hf_greedy(refs[name], p, 8), skip_special_tokens=True))
                for name, p in jobs]
    assert got == expected
    assert len({text for _, text in got[:3]}) == 3  # (three models, three answers)


def test_unknown_adapter_is_404(served):
    thread, _ = served
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="x")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt=[5, 6], max_tokens=2)
    assert err.value.body["message"] == "The model `nope` does not exist."
