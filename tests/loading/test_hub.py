"""Models by name from a hub, against a fake hub on 127.0.0.1 (tests/fake_hub.py) serving a
tiny random model: download and verification, resume after the server cuts a file, offline
reuse of the verified cache, revision pinning, one-line errors (unknown repository or
revision, gated, unreachable, corrupt bytes), file selection, and names used where paths are:
`LLM("org/tiny")`, `tokenmill serve org/tiny`, `start_server org/tiny/weight_only_int8`."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.fake_hub import FakeHub
from tokenmill.config.model_names import split_precision
from tokenmill.hub.download import MARKER, HubError, select_files
from tokenmill.hub.fetch import cached, fetch, resolve


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def hub(tiny_models, tmp_path):
    src = tiny_models("llama")[0]
    v1 = str(tmp_path / "v1")
    shutil.copytree(src, v1)
    with open(os.path.join(v1, "generation_config.json"), "w") as f:
        json.dump({"max_new_tokens": 7}, f)  # (tells the two revisions apart)
    with open(os.path.join(src, "README.md"), "w") as f:
        f.write("a file the engine does not need")
    with FakeHub() as h:
        h.add("org/tiny", v1, refs=("v1",))
        h.add("org/tiny", src, refs=("main",))
        h.src = src
        yield h


def _fetch(hub, tmp_path, repo="org/tiny", **kw):
    return fetch(repo, endpoint=hub.url, cache_dir=str(tmp_path / "cache"), **kw)


def test_download_verifies_and_takes_only_what_the_engine_loads(hub, tmp_path):
    path = _fetch(hub, tmp_path)
    got = sorted(f for f in os.listdir(path) if f != MARKER)
    assert "README.md" not in got and "model.safetensors" in got and "config.json" in got
    for name in got:
        assert _digest(os.path.join(path, name)) == _digest(os.path.join(hub.src, name))
    with open(os.path.join(path, MARKER)) as f:
        assert sorted(json.load(f)) == got
    assert cached("org/tiny", cache_dir=str(tmp_path / "cache")) == path


def test_resume_after_the_connection_is_cut(hub, tmp_path, monkeypatch):
    """The server cuts model.safetensors half-way, then closes every connection for it
    unanswered: huggingface_hub resumes within the run (a Range request) until it gives up;
    the run fails with a one-line error keeping what arrived; the next run resumes from
    there (another Range request past the first half) and ends verified."""
    import huggingface_hub.constants as constants
    import huggingface_hub.file_download as file_download

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # (partial chunks land)
    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)
    size = os.path.getsize(os.path.join(hub.src, "model.safetensors"))
    hub.cuts["model.safetensors"], hub.drops["model.safetensors"] = 1, 12
    with pytest.raises(HubError, match="connection dropped.*run again"):
        _fetch(hub, tmp_path)
    assert cached("org/tiny", cache_dir=str(tmp_path / "cache")) is None
    hub.drops["model.safetensors"] = 0
    path = _fetch(hub, tmp_path)
    ranges = [int(r.split("=")[1].rstrip("-")) for m, p, r in hub.requests
              if m == "GET" and p.endswith("model.safetensors") and r]
    assert ranges and ranges[-1] >= size // 2 - 4096
    assert _digest(os.path.join(path, "model.safetensors")) == \
        _digest(os.path.join(hub.src, "model.safetensors"))


def test_offline_reuse_and_revision_pinning(hub, tmp_path):
    cache = str(tmp_path / "cache")
    main = _fetch(hub, tmp_path)
    v1 = _fetch(hub, tmp_path, revision="v1")
    with open(os.path.join(v1, "generation_config.json")) as f:
        assert json.load(f) == {"max_new_tokens": 7}
    assert v1 != main
    hub.__exit__()  # the hub is gone: names resolve from the verified cache
    assert resolve("org/tiny", cache_dir=cache) == main
    assert resolve("org/tiny", revision="v1", cache_dir=cache) == v1
    with pytest.raises(HubError, match="not a local path.*org/other"):
        resolve("org/other", cache_dir=cache, endpoint=hub.url)


def test_a_corrupt_file_is_removed_and_named(hub, tmp_path):
    hub.corrupt.add("model.safetensors")
    with pytest.raises(HubError, match="model.safetensors failed verification"):
        _fetch(hub, tmp_path)
    assert cached("org/tiny", cache_dir=str(tmp_path / "cache")) is None
    hub.corrupt.clear()
    assert os.path.isfile(os.path.join(_fetch(hub, tmp_path), "model.safetensors"))


@pytest.mark.parametrize("case, match", [
    ({"repo": "org/missing"}, "No model 'org/missing'"),
    ({"revision": "v9"}, "has no revision 'v9'"),
    ({"repo": "org/DeepSeek-R1-2nodes"}, "seed name"),
    ({"gated": True}, "gated repository.*HF_TOKEN"),
])
def test_one_line_errors(hub, tmp_path, case, match):
    if case.pop("gated", False):
        hub.gated.add("org/tiny")
    with pytest.raises(HubError, match=match) as info:
        _fetch(hub, tmp_path, **case)
    assert "\n" not in str(info.value)


def test_unreachable_hub(tmp_path):
    from tests.serving import free_port

    with pytest.raises(HubError, match="Cannot reach the hub"):
        fetch("org/tiny", endpoint=f"http://127.0.0.1:{free_port()}",
              cache_dir=str(tmp_path / "c"))


def test_file_selection():
    st = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "tokenizer.json", "pytorch_model.bin", "README.md",
          "original/consolidated.00.pth", "chat_template.jinja", "merges.txt"]
    assert select_files(st) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja", "merges.txt"]
    assert select_files(st, exclude=["*.jinja"])[-1] == "merges.txt"
    ggufs = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-f16.gguf"]
    assert select_files(ggufs, gguf_quant="q4_k_m") == ["m-Q4_K_M.gguf"]
    assert select_files(ggufs, gguf_file="m-Q8_0.gguf") == ["m-Q8_0.gguf"]
    with pytest.raises(HubError, match="3 GGUF files.*--gguf-quant"):
        select_files(ggufs)
    assert select_files(["a.gguf", "README.md"]) == ["a.gguf"]
    with pytest.raises(HubError, match="only PyTorch .bin"):
        select_files(["config.json", "pytorch_model.bin"])


def test_a_node_selects_its_ranks_files():
    files = ["config.json", "tokenmill_sharding.json", "tokenizer.json"] + \
        [f"rank{r}.safetensors" for r in range(4)]
    assert select_files(files, node=(1, 2)) == [
        "config.json", "tokenmill_sharding.json", "tokenizer.json", "rank2.safetensors",
        "rank3.safetensors"]
    assert select_files(files, node=(0, 4))[-1] == "rank0.safetensors"
    assert select_files(files) == select_files(files, node=(0, 1)) == files
    with pytest.raises(HubError, match="sharded for 4 ranks, which 3 nodes cannot share"):
        select_files(files, node=(0, 3))
    plain = ["config.json", "model.safetensors"]  # (not pre-sharded: every node takes all)
    assert select_files(plain, node=(1, 2)) == plain


def test_a_node_fetches_only_its_share_of_a_sharded_checkpoint(tiny_models, tmp_path):
    """`tokenmill download --nnodes 2 --mode slave` of a folder written by `tokenmill
    convert --tp-size 2`: node 1's rank file and the small files, never rank 0's; the cached
    copy counts as fetched for node 1 only, until node 0's share is fetched too."""
    from tokenmill.entrypoints.cli import main as cli

    sharded = str(tmp_path / "tp2")
    assert cli(["convert", tiny_models("llama")[0], sharded, "--tp-size", "2"]) == 0
    home = tmp_path / "home"
    with FakeHub() as h:
        h.add("org/tiny-tp2", sharded)
        env = {**os.environ, "HF_ENDPOINT": h.url, "HF_HOME": str(home)}
        got = _cli(["download", "org/tiny-tp2", "--nnodes", "2", "--mode", "slave"], env,
                   tmp_path)
        assert got.returncode == 0, got.stderr
        path = got.stdout.strip()
        assert "rank1.safetensors" in os.listdir(path)
        assert "rank0.safetensors" not in os.listdir(path)
        assert "tokenmill_sharding.json" in os.listdir(path)
        assert not any("rank0" in p for _, p, _ in h.requests)
        assert _digest(os.path.join(path, "rank1.safetensors")) == \
            _digest(os.path.join(sharded, "rank1.safetensors"))
        hub_cache = str(home / "hub")
        assert cached("org/tiny-tp2", cache_dir=hub_cache, node=(1, 2)) == path
        assert cached("org/tiny-tp2", cache_dir=hub_cache, node=(0, 2)) is None
        assert cached("org/tiny-tp2", cache_dir=hub_cache) is None  # (one node: all ranks)
        bad = _cli(["download", "org/tiny-tp2", "--nnodes", "3", "--mode", "slave"], env,
                   tmp_path)
        assert bad.returncode == 2 and "--node-rank" in bad.stderr
        got = _cli(["download", "org/tiny-tp2", "--nnodes", "2", "--node-rank", "0"], env,
                   tmp_path)
        assert got.returncode == 0, got.stderr
    assert cached("org/tiny-tp2", cache_dir=hub_cache, node=(0, 2)) == path
    assert cached("org/tiny-tp2", cache_dir=hub_cache) == path


def test_seed_precision_names():
    assert split_precision("deepseek-ai/DeepSeek-R1/weight_only_int8") == (
        "deepseek-ai/DeepSeek-R1", {"quantization": "int8"})
    assert split_precision("org/m/bfloat16") == ("org/m", {"dtype": "bfloat16"})
    assert split_precision("org/m/a8w8_fp8")[1] == {"quantization": "fp8"}
    assert split_precision("org/m") == ("org/m", {})
    with pytest.raises(ValueError, match="weight_only_int8"):
        split_precision("org/m/int3")


def _cli(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_names_where_paths_go(hub, tmp_path, tiny_models):
    """`tokenmill download` prints the path; then, with the hub gone (HF_HUB_OFFLINE),
    `tokenmill generate --model org/tiny` and `--model org/tiny/weight_only_int8` load the
    cached copy (the second quantized: its greedy text differs from fp32's only if int8
    changes the argmax, so it is checked against an int8 load of the local folder)."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home")}
    got = _cli(["download", "org/tiny"], env, tmp_path)
    assert got.returncode == 0, got.stderr
    path = got.stdout.strip().splitlines()[-1]
    assert os.path.isfile(os.path.join(path, MARKER))
    bad = _cli(["download", "org/missing"], env, tmp_path)
    assert bad.returncode == 2 and "No model 'org/missing'" in bad.stderr
    assert "Traceback" not in bad.stderr
    hub.__exit__()
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    gen = ["generate", "--prompt", "Paris is", "--max-tokens", "5", "--kv-cache-memory", "0.02"]
    for name, local in (("org/tiny", []), ("org/tiny/weight_only_int8", ["-q", "int8"])):
        by_name = _cli([*gen, "--model", name], offline, tmp_path)
        by_path = _cli([*gen, "--model", tiny_models("llama")[0], *local], offline, tmp_path)
        assert by_name.returncode == 0, by_name.stderr
        assert by_name.stdout == by_path.stdout


def test_start_server_by_seed_name_downloads_and_serves_int8(hub, tmp_path, tiny_models):
    """`start_server org/tiny/weight_only_int8` with HF_ENDPOINT at the fake hub: the server
    downloads the model at start-up and serves it int8 (greedy text equal to an int8 load of
    the same checkpoint); stop_server ends it."""
    import httpx

    from tests.serving import Served, alive, wait_until
    from tokenmill import LLM, SamplingParams

    served = Served("org/tiny/weight_only_int8", tmp_path)
    served.env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home"))
    bin_dir = os.path.dirname(sys.executable)
    start = subprocess.run([os.path.join(bin_dir, "start_server"), *served.args],
                           env=served.env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert start.returncode == 0, start.stderr
    pid = int((tmp_path / "log" / "server.pid").read_text())
    try:
        assert wait_until(lambda: served.ready() or not alive(pid), 300)
        assert served.ready(), (tmp_path / "log" / "server.log").read_text()[-3000:]
        got = httpx.post(served.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "Paris is", "max_tokens": 6, "temperature": 0}).json()
        with LLM(tiny_models("llama")[0], quantization="int8", kv_cache_memory_gib=0.02) as llm:
            want = llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].text
        assert got["choices"][0]["text"] == want
        assert any(p.endswith("model.safetensors") for _, p, _ in hub.requests)
    finally:
        subprocess.run([os.path.join(bin_dir, "stop_server"), "60"], env=served.env,
                       cwd=tmp_path, capture_output=True, timeout=120)
        assert not alive(pid)


def test_serve_by_name_at_a_revision_into_a_download_dir(hub, tmp_path):
    """vLLM's `--revision` and `--download-dir`: `tokenmill serve org/tiny --revision v1`
    fetches that revision into the folder given, and serves it with the revision's
    generation config (v1's max_new_tokens 7 caps a request's max_tokens)."""
    import httpx

    from tests.serving import Served

    downloads = tmp_path / "downloads"
    served = Served("org/tiny", tmp_path, "--revision", "v1", "--download-dir", str(downloads))
    served.env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home"))
    with served.running():
        got = httpx.post(served.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "Paris is", "max_tokens": 20, "ignore_eos": True})
    assert got.json()["usage"]["completion_tokens"] == 7
    [snapshot] = (downloads / "models--org--tiny" / "snapshots").iterdir()
    assert json.loads((snapshot / "generation_config.json").read_text()) == {
        "max_new_tokens": 7}
    assert not (tmp_path / "home" / "hub" / "models--org--tiny").exists()


def test_the_seed_downloaders_flags_and_md5_check(hub, tmp_path):
    """`--model_name ORG/NAME/<precision> --dir D --nnodes 2 --mode slave
    --speculate_model_path P`: the model lands in D/ORG/NAME, the precision is named for
    serving, P links to the model (its MTP layers are its own). MD5_CHECK=1 hashes files
    already there again: one changed in place is found, removed and fetched again."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home")}
    seed = ["download", "--model_name", "org/tiny/weight_only_int8", "--dir", "dl",
            "--nnodes", "2", "--mode", "slave", "--speculate_model_path", "mtp"]
    got = _cli(seed, env, tmp_path)
    assert got.returncode == 0, got.stderr
    folder = tmp_path / "dl" / "org" / "tiny"
    assert got.stdout.strip() == str(folder) and "--quantization int8" in got.stderr
    assert os.path.realpath(tmp_path / "mtp") == str(folder)
    weights = folder / "model.safetensors"
    data, before = bytearray(weights.read_bytes()), weights.stat()
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # (same size and time: only hashing finds it;
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # huggingface_hub
    # re-hashes a local file changed after its download, whatever MD5_CHECK says)
    assert _cli(seed, env, tmp_path).returncode == 0  # trusted as verified before
    checked = _cli(seed, {**env, "MD5_CHECK": "1"}, tmp_path)
    assert checked.returncode == 2 and "model.safetensors failed verification" in checked.stderr
    assert _cli(seed, {**env, "MD5_CHECK": "1"}, tmp_path).returncode == 0
    assert _digest(str(weights)) == _digest(os.path.join(hub.src, "model.safetensors"))


def test_hub_source_from_the_environment():
    from tokenmill.config.env import hub_source

    assert hub_source({}) == "hf"
    assert hub_source({"TOKENMILL_USE_MODELSCOPE": "1"}) == "modelscope"
    assert hub_source({"VLLM_USE_MODELSCOPE": "True"}) == "modelscope"  # (vLLM's spelling)
    assert hub_source({"VLLM_USE_MODELSCOPE": "false"}) == "hf"
    with pytest.raises(ValueError, match="TOKENMILL_USE_MODELSCOPE must be 0 or 1"):
        hub_source({"TOKENMILL_USE_MODELSCOPE": "yes"})


def test_modelscope_source(tiny_models, tmp_path):
    """`tokenmill download --source modelscope` against a fake ModelScope (its listing
    endpoint and file endpoint, on 127.0.0.1): the engine's files, verified against the
    listing's sha256; a connection cut mid-file resumes (Range); a file served corrupt is
    never kept and the error is one line; unknown repository / revision named; then, with
    the hub gone, TOKENMILL_USE_MODELSCOPE=1 resolves the name from the cache and generates
    what the local folder generates."""
    pytest.importorskip("modelscope")
    src = tiny_models("llama")[0]
    cache = tmp_path / "ms-cache"
    with FakeHub() as h:
        h.add("org/tiny", src, refs=("master",))
        env = {**os.environ, "MODELSCOPE_ENDPOINT": h.url, "MODELSCOPE_CACHE": str(cache)}
        h.corrupt.add("model.safetensors")
        bad = _cli(["download", "org/tiny", "--source", "modelscope"], env, tmp_path)
        assert bad.returncode == 2 and "sha256" in bad.stderr and "Traceback" not in bad.stderr
        assert not any(p.name == "model.safetensors" for p in cache.rglob("*"))
        h.corrupt.clear()
        h.cuts["model.safetensors"] = 1
        got = _cli(["download", "org/tiny", "--source", "modelscope"], env, tmp_path)
        assert got.returncode == 0, got.stderr
        path = got.stdout.strip()
        assert any(r and r.startswith("bytes=") and r != "bytes=0-"
                   for _, _, r in h.requests)  # (resumed past the cut)
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert _digest(os.path.join(path, name)) == _digest(os.path.join(src, name))
        assert os.path.isfile(os.path.join(path, MARKER))
        for args, match in ((["org/nope"], "no such model"),
                            (["org/tiny", "--revision", "v9"], "no revision 'v9'")):
            failed = _cli(["download", *args, "--source", "modelscope"], env, tmp_path)
            assert failed.returncode == 2 and match in failed.stderr, failed.stderr
    offline = {**env, "TOKENMILL_USE_MODELSCOPE": "1"}
    gen = ["generate", "--prompt", "Paris is", "--max-tokens", "5", "--kv-cache-memory", "0.02"]
    by_name = _cli([*gen, "--model", "org/tiny"], offline, tmp_path)
    assert by_name.returncode == 0, by_name.stderr
    local = _cli([*gen, "--model", src], env, tmp_path)
    assert by_name.stdout == local.stdout and local.stdout.strip()
