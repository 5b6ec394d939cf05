"""The user guide cannot rot: it builds strictly (no broken link or anchor, no page left out
of the navigation), its configuration page is the one generated from the code, every
environment variable tokenmill reads is in that page's table, and every example marked
`<!-- runs -->` (in the guide and the README) runs against the bundled model's server, as
does every Python example (a command line with placeholders may stay unmarked); one marked
`<!-- runs pooling -->` runs against the bundled model served for pooling
(`--runner pooling`: embeddings, scores), one marked `<!-- runs images -->` against a tiny
random LLaVA (image inputs)."""

import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sys

import pytest

from tests.serving import Served

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARK = r"<!-- runs(?: (pooling|images))? -->"


def _runnable_blocks() -> list[tuple[str, str, str, str]]:
    """(where, language, code, server) of every fenced block right after a marker."""
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text()
        for i, match in enumerate(re.finditer(MARK + r"\n```(\w+)\n(.*?)\n```", text, re.S)):
            found.append((f"{path.relative_to(ROOT)}#{i}", match.group(2), match.group(3),
                          match.group(1) or ""))
    return found


BLOCKS = _runnable_blocks()


def test_every_marked_block_is_found():
    """A marker not followed directly by a fenced block would silently run nothing."""
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        text = path.read_text()
        marks = len(re.findall("^" + MARK + "$", text, re.M))
        assert marks == len(re.findall(MARK + r"\n```\w+\n", text)), path
        python = len(re.findall(r"^```python$", text, re.M))
        assert python == len(re.findall(MARK + r"\n```python\n", text)), \
            f"{path}: a Python example that is not run"
    assert len(BLOCKS) >= 8


def test_the_configuration_page_is_generated_from_the_code():
    gen = runpy.run_path(str(DOCS / "gen_reference.py"))
    assert (DOCS / "configuration.md").read_text() == gen["render"](), \
        "docs/configuration.md is out of date: run python docs/gen_reference.py"


def test_every_environment_variable_read_is_in_the_reference():
    from tokenmill.config.env import VARIABLES

    reads = re.compile(r"""(?:env|Env\([^)]*\)|environ)\.(?:text|integer|number|flag|raw|get)"""
                       r"""\(((?:"[A-Z][A-Z0-9_]+"(?:, )?)+)""")
    read = set()
    for path in (ROOT / "tokenmill").rglob("*.py"):
        for match in reads.finditer(path.read_text()):
            read |= set(re.findall(r'"([A-Z][A-Z0-9_]+)"', match.group(1)))
    read -= {"PROMETHEUS_MULTIPROC_DIR"}  # (set by the server for its workers, not a setting)
    assert read <= set(VARIABLES), sorted(read - set(VARIABLES))
    source = "".join(p.read_text() for p in (ROOT / "tokenmill").rglob("*.py")
                     if p.name != "env.py")
    stale = [name for name in VARIABLES if f'"{name}"' not in source and name not in read]
    assert not stale, stale


def test_the_guide_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # (with the ChatML template the repository ships, so the tool-calling example runs too)
    template = ROOT / "examples" / "tool_chat_template_chatml.jinja"
    served = Served("", tmp_path_factory.mktemp("docs"), "--max-model-len", "1024",
                    "--chat-template", str(template))
    served.args.remove("")  # no MODEL argument: the bundled default
    served.args[served.args.index("tiny")] = "default"
    with served.running(timeout=300):
        yield served


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    served = Served("", tmp_path_factory.mktemp("docs"), "--max-model-len", "1024",
                    "--runner", "pooling")
    served.args.remove("")
    served.args[served.args.index("tiny")] = "default"
    with served.running(timeout=300):
        yield served


@pytest.fixture(scope="module")
def images_server(tmp_path_factory):
    from helpers import make_llava

    path = str(tmp_path_factory.mktemp("docs") / "llava")
    make_llava(path)
    served = Served(path, tmp_path_factory.mktemp("docs"), "--max-model-len", "1024")
    served.args[served.args.index("tiny")] = "default"
    with served.running(timeout=300):
        yield served


@pytest.mark.parametrize("where,language,code,kind", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_the_example_runs(request, where, language, code, kind, tmp_path):
    server = request.getfixturevalue(f"{kind}_server" if kind else "server")
    ports = {"9965": server.ports["port"], "8811": server.ports["grpc"],
             "8110": server.ports["health"], "8722": server.ports["metrics"]}
    code = re.sub(r"\b(9965|8811|8110|8722)\b", lambda m: str(ports[m.group(1)]), code)
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    if language == "python":
        command = [sys.executable, "-c", code]
    elif language == "bash":
        if "curl" in code and shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        raise AssertionError(f"{where}: a runnable block must be python or bash")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{where}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{where} printed nothing"
