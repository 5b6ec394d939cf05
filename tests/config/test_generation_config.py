"""Default sampling parameters from a model's generation_config.json (vLLM's
`--generation-config auto|vllm|FOLDER`, `--override-generation-config`): what is read, what is
refused and named (bad flags: test_server_config.py's table), and that the OpenAI API, the
offline LLM and `tokenmill serve` use them (a request's own values win; max_new_tokens caps
every request)."""

import json
import os

import openai
import pytest

from tests.serving import Served, service_thread
from tokenmill import LLM, SamplingParams
from tokenmill.config.generation import sampling_defaults

# DeepSeek-R1's sampling fields, a top_k, a cap, and fields that are not sampling defaults
R1_LIKE = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6,
           "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "min_p": None,
           "transformers_version": "4.46.3"}
READ = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}


def _folder(tmp_path, config: dict, name="gen") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_sampling_fields_that_are_set_are_read(tmp_path):
    model = _folder(tmp_path, R1_LIKE, "model")
    assert sampling_defaults(model) == READ  # auto: the model's own file
    assert sampling_defaults(model, "vllm") == {}
    other = _folder(tmp_path, {"repetition_penalty": 1.05, "temperature": 0.7})
    assert sampling_defaults(model, other) == {"repetition_penalty": 1.05, "temperature": 0.7}
    assert sampling_defaults(model, "auto", {"temperature": 0.2, "max_new_tokens": 3}) == {
        **READ, "temperature": 0.2, "max_tokens": 3}
    assert sampling_defaults(model, "vllm", {"top_k": 5}) == {"top_k": 5}
    # a model without the file (or a GGUF file's path): no defaults
    assert sampling_defaults(str(tmp_path)) == {}
    assert sampling_defaults(str(tmp_path / "model.gguf")) == {}
    assert SamplingParams(**READ).max_tokens == 7


@pytest.mark.parametrize("config, setting, override, message", [
    ({"temperature": -1}, "auto", None, r"generation_config.json: temperature -1 is not a "
                                        r"usable sampling default \(temperature must"),
    ({"top_k": "many"}, "auto", None, r"json: top_k 'many' is not a usable"),
    ({"max_new_tokens": 4}, "auto", {"max_new_tokens": 0},
     r"^--override-generation-config: max_new_tokens 0 is not a usable"),
    ({}, "/no/such/folder", None, r"--generation-config '/no/such/folder': no "
                                  r"generation_config.json there"),
])
def test_a_bad_default_is_named(tmp_path, config, setting, override, message):
    model = _folder(tmp_path, config, "model")
    with pytest.raises(ValueError, match=message):
        sampling_defaults(model, setting, override)


def test_a_broken_file_is_named(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not readable JSON"):
        sampling_defaults(str(model))


def test_the_offline_llm_uses_them_when_given_no_params(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    folder = _folder(tmp_path, {"temperature": 0.8, "top_k": 3, "max_new_tokens": 5})
    with LLM(path, kv_cache_memory_gib=0.02, generation_config=folder) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.8, top_k=3,
                                                                   max_tokens=5)
        [by_default] = llm.generate("Once upon a time", use_tqdm=False)
        assert len(by_default.outputs[0].token_ids) == 5
        seeded = llm.get_default_sampling_params().clone(seed=3)
        [a, b] = llm.generate(["Once upon a time"] * 2, [seeded, SamplingParams(
            temperature=0.8, top_k=3, max_tokens=5, seed=3)], use_tqdm=False)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with LLM(path, kv_cache_memory_gib=0.02, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_openai_requests_take_them_where_unset(engine_address, offline_llm, tmp_path):
    path, address = engine_address
    defaults = {"temperature": 0.8, "top_k": 3, "max_tokens": 6}
    with service_thread(path, address, max_dec_len=256, sampling_defaults=defaults) as thread:
        client = openai.OpenAI(base_url=thread.base + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Name a color."}]
        unset = client.chat.completions.create(model="tiny", messages=messages, seed=11)
        asked = client.chat.completions.create(model="tiny", messages=messages, seed=11,
                                               max_tokens=4, temperature=0)
        over = client.completions.create(model="tiny", prompt="Once", max_tokens=50, seed=2)
    assert unset.usage.completion_tokens == 6 and unset.choices[0].finish_reason == "length"
    # the request's own values win (greedy here), and the cap holds over an explicit 50
    assert asked.usage.completion_tokens == 4
    assert over.usage.completion_tokens == 6
    prompt = offline_llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    [want] = offline_llm.generate(prompt, SamplingParams(
        temperature=0.8, top_k=3, max_tokens=6, seed=11), use_tqdm=False)
    assert unset.choices[0].message.content == want.outputs[0].text
    [greedy] = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4),
                                    use_tqdm=False)
    assert asked.choices[0].message.content == greedy.outputs[0].text


def test_serve_reads_the_flags_and_refuses_a_bad_file_before_loading(tiny_models, tmp_path):
    path = tiny_models("llama")[0]
    folder = _folder(tmp_path, {"max_new_tokens": 3})
    with Served(path, tmp_path, "--generation-config", folder,
                "--override-generation-config", '{"temperature": 0}').running() as served:
        client = openai.OpenAI(base_url=served.api + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="tiny", prompt="Once", max_tokens=20)
        again = client.completions.create(model="tiny", prompt="Once", max_tokens=20)
    assert done.usage.completion_tokens == 3 and done.choices[0].text == again.choices[0].text
    broken = _folder(tmp_path, {"temperature": -2}, "broken")
    served = Served(path, tmp_path, "--generation-config", broken).start()
    try:
        assert served.process.wait(300) != 0
        log = served.process.stdout.read().decode()
    finally:
        served.stop()
    assert "broken" + os.sep + "generation_config.json: temperature -2 is not a usable" in log
    assert "Traceback" not in log
