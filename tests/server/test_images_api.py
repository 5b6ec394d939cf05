"""Images in OpenAI chat requests, through the `openai` SDK: `image_url` parts (base64 data
URLs, or http URLs of an allowed host) to a tiny LLaVA give transformers' greedy answer for
the same conversation (and to a tiny Qwen2.5-VL, dynamic resolution and M-RoPE); the
bad images (a decompression bomb, a truncated or non-image file,
bad base64, a host not allowed, a redirect away from the allowed ones, too large, too many
images, an image for a text model) get 400 in the OpenAI shape, naming the cause, and the
server goes on serving."""

import base64

import openai
import pytest
import torch
from helpers import data_url, make_llava, make_qwen_vl, png, qwen_vl_greedy
from helpers import random_image as picture
from PIL import Image

from tests.serving import service_over_engine


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served_llava") / "tiny")
    model, processor = make_llava(path)
    with service_over_engine(path, engine={"limit_mm_per_prompt": {"image": 2}},
                             max_dec_len=64, allowed_media_domains=["127.0.0.1"]) as thread:
        yield thread, model, processor


def _messages(images, text="What is in these pictures?"):
    return [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in images),
        {"type": "text", "text": text}]}]


def test_chat_with_images_equals_transformers(llava):
    thread, model, processor = llava
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    images = [picture(1, 40, 50), picture(2, 64, 32)]
    answer = client.chat.completions.create(model="tiny", messages=_messages(images),
                                            max_tokens=8, temperature=0)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text",
                                              "text": "What is in these pictures?"}]}]
    text = processor.tokenizer.apply_chat_template(template, tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("url, why", [
    (data_url(png(Image.new("1", (8000, 8000)))), "pixels"),
    (data_url(png(picture(3, 20, 20))[:60]), "truncated or corrupt"),
    (data_url(b"%PDF-1.4 not an image", "pdf"), "not a PNG"),
    ("data:image/png;base64,***", "not valid base64"),
    ("https://example.com/cat.png", "fetched only from 127.0.0.1"),
    ("file:///etc/passwd", "base64 data URL"),
])
def test_bad_images_get_400_naming_the_cause(llava, url, why):
    thread = llava[0]
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=why) as refused:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "hi"}]}])
    assert "Traceback" not in str(refused.value.body)
    with pytest.raises(openai.BadRequestError, match="at most 2 images"):
        client.chat.completions.create(model="tiny", max_tokens=4,
                                       messages=_messages([picture(4, 10, 10)] * 3))
    ok = client.chat.completions.create(model="tiny", max_tokens=4,
                                        messages=_messages([picture(5, 10, 10)]))
    assert ok.choices[0].finish_reason == "length"


def test_qwen_vl_chat_equals_transformers(tmp_path):
    """Qwen2.5-VL through the server: the chat template's vision markers around each image,
    the image processor's grid deciding its rows; an image too large for the context gets
    400 naming the limit."""
    path = str(tmp_path / "qwen_vl")
    model, images, tok = make_qwen_vl(path)
    imgs = [picture(1, 90, 50), picture(2, 100, 120)]
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "What is this?"}]}]
    text = tok.apply_chat_template(template, tokenize=False, add_generation_prompt=True)
    ids, tokens = qwen_vl_greedy(model, images, tok, text, imgs)
    with service_over_engine(path, engine={"max_model_len": 60}, max_dec_len=64) as thread:
        client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=_messages(imgs, "What is this?"), max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True})
        large = Image.new("RGB", (800, 800), (20, 90, 200))  # (64 rows: the processor's most)
        with pytest.raises(openai.BadRequestError, match=r"64 tokens, more than max_model_len"):
            client.chat.completions.create(model="tiny", max_tokens=4,
                                           messages=_messages([large]))
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)


def test_a_text_model_refuses_images(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model="tiny", max_tokens=4,
                                       messages=_messages([picture(6, 10, 10)]))


def test_native_and_triton_routes_take_images(llava):
    import httpx

    thread, model, processor = llava
    images = [picture(8, 30, 40)]
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=_messages(images),
                                          max_tokens=8, temperature=0)
    native = httpx.post(thread.base + "/v1/chat/completions", timeout=60, json={
        "messages": _messages(images), "max_dec_len": 8, "temperature": 0,
        "stream": False}).json()
    assert native["result"] == chat.choices[0].message.content
    text = "Here <image> is a picture"
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    triton = httpx.post(thread.base + "/v2/models/tiny/generate", timeout=60, json={
        "text_input": text, "image_url_input": data_url(png(images[0])), "max_tokens": 6,
        "top_k": 1, "exclude_input_in_output": True}).json()
    assert triton["text_output"] == processor.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    refused = httpx.post(thread.base + "/v2/models/tiny/generate", timeout=60, json={
        "text_input": "no image token", "image_url_input": [data_url(png(images[0]))],
        "max_tokens": 2})
    assert refused.status_code == 400 and "places 0 images" in refused.json()["error"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A loopback file server: /cat.png, /big.png (over 20 MiB), /away (a redirect to
    another host), /gone (404)."""
    import http.server
    import threading

    from tests.serving import free_port

    cat = png(picture(9, 40, 40))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:1/cat.png")
                self.end_headers()
                return
            body = {"/cat.png": cat, "/big.png": b"\0" * (21 << 20)}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", cat
    server.shutdown()
    thread.join(10)


def test_remote_images_from_allowed_hosts_only(llava, media):
    thread = llava[0]
    base, cat = media
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)

    def ask(url):
        return client.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": [
                                                  {"type": "image_url",
                                                   "image_url": {"url": url}},
                                                  {"type": "text", "text": "hi"}]}])
    fetched = ask(base + "/cat.png")
    sent = ask(data_url(cat))
    assert fetched.choices[0].message.content == sent.choices[0].message.content
    for path, why in (("/away", "fetched only from 127.0.0.1"), ("/big.png", "at most 20 MiB"),
                      ("/gone", "HTTP 404")):
        with pytest.raises(openai.BadRequestError, match=why):
            ask(base + path)


def test_anthropic_and_responses_clients_send_images(llava):
    import anthropic

    thread = llava[0]
    images = [picture(11, 30, 30)]
    encoded = base64.b64encode(png(images[0])).decode()
    client = openai.OpenAI(base_url=thread.base + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=_messages(images),
                                          max_tokens=8, temperature=0)
    expected = chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=thread.base, api_key="none", max_retries=0)
    message = claude.messages.create(
        model="tiny", max_tokens=8, extra_body={"temperature": 0}, messages=[{
            "role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": encoded}},
                {"type": "text", "text": "What is in these pictures?"}]}])
    assert message.content[0].text == expected
    response = client.responses.create(model="tiny", max_output_tokens=8, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_image",
                                            "image_url": data_url(png(images[0]))},
                                           {"type": "input_text",
                                            "text": "What is in these pictures?"}]}])
    assert response.output_text == expected
