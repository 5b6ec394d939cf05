"""What the server tests share: a tiny model behind a Hermes-style chat template (as Qwen
2.5's), for tool calling over the OpenAI, Anthropic and Responses routes."""

import pytest

TEMPLATE = (
    "{%- if tools %}<s>system: You may call these tools:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant: {{ m.content or '' }}"
    "{%- for call in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}\n"
    "{%- elif m.role == 'tool' %}<s>tool: <tool_response>{{ m.content }}</tool_response>\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def tool_model(tiny_models, tmp_path_factory):
    """(folder, tokenizer) of the tiny Llama with TEMPLATE as its chat template."""
    import shutil

    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tools") / "llama")
    shutil.copytree(tiny_models("llama")[0], path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path, tok
