"""Every command a newcomer may type answers `--help` (exit 0, a usage line), and a bad
argument is a usage error, not a traceback; every module is in a package an install
includes."""

import pathlib
import subprocess
import sys

import pytest

_CLI = [sys.executable, "-m", "tokenmill.entrypoints.cli"]
_LAUNCHER = [sys.executable, "-c", "import sys; from tokenmill.entrypoints.launcher import "
             "{}; sys.exit({}(sys.argv[1:]))"]


def launcher(name: str) -> list[str]:
    return [*_LAUNCHER[:2], _LAUNCHER[2].format(name, name)]


@pytest.mark.parametrize("command,usage", [
    (_CLI, "usage: tokenmill"), ([*_CLI, "serve"], "usage: tokenmill serve"),
    ([*_CLI, "generate"], "usage: tokenmill generate"),
    ([*_CLI, "quantize"], "usage: tokenmill quantize"),
    ([*_CLI, "convert"], "usage: tokenmill convert"),
    ([*_CLI, "download"], "usage: tokenmill download"),
    ([*_CLI, "bench", "offline"], "usage: offline_throughput.py"),
    ([*_CLI, "bench", "serve"], "usage: serve_load.py"),
    (launcher("start_server_main"), "usage: start_server"),
    (launcher("stop_server_main"), "usage: stop_server"),
], ids=["tokenmill", "serve", "generate", "quantize", "convert", "download", "bench-offline",
        "bench-serve", "start_server", "stop_server"])
def test_every_entry_point_answers_help(command, usage):
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(usage), done.stdout[:200]


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    import tokenmill

    done = subprocess.run([*_CLI, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"tokenmill {version('tokenmill')}"
    assert tokenmill.__version__ == version("tokenmill")  # (pyproject and package agree)


def test_every_generate_option_says_what_it_does():
    from tokenmill.entrypoints.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    options = [a for a in commands["generate"]._actions if a.option_strings]
    assert len(options) > 10
    assert [a.dest for a in options if not a.help] == []


# modules of the extras (pyproject's optional-dependencies) that no base dependency brings
_EXTRAS_ONLY = {"ray": "ray", "triton": "triton", "xgrammar": "xgrammar",
                "opentelemetry-sdk": "opentelemetry.sdk",
                "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter",
                "modelscope": "modelscope", "matplotlib": "matplotlib", "openai": "openai",
                "accelerate": "accelerate", "pytest": "pytest", "hypothesis": "hypothesis",
                "schemathesis": "schemathesis", "psutil": "psutil", "jsonschema": "jsonschema"}


def test_the_base_install_serves_and_generates(tiny_models):
    """Serving needs the base package only: with every extra's own modules missing, the
    server's modules import and `tokenmill generate` answers."""
    import re
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    base = {re.split(r"[<>=;\[ ]", d)[0].lower() for d in project["project"]["dependencies"]}
    extras = {re.split(r"[<>=;\[ ]", d)[0].lower()
              for deps in project["project"]["optional-dependencies"].values() for d in deps}
    assert set(_EXTRAS_ONLY) <= extras - base
    code = ("import sys\n"
            f"for name in {sorted(_EXTRAS_ONLY.values())!r}: sys.modules[name] = None\n"
            "import tokenmill.entrypoints.serve, tokenmill.entrypoints.api_worker\n"
            "from tokenmill.entrypoints.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "generate", "--model",
                           tiny_models("llama")[0], "--prompt", "Paris is", "--max-tokens", "3",
                           "--kv-cache-memory", "0.02"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.endswith("\n")  # (the completion, whatever a random model says)


def test_stop_server_with_a_bad_timeout_is_a_usage_error(tmp_path):
    done = subprocess.run([*launcher("stop_server_main"), "soon"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "invalid float value: 'soon'" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_module_is_in_a_package_an_install_includes():
    """pyproject's `packages.find` (setuptools) takes folders with an __init__.py only: a
    folder without one works from a checkout and is missing from a wheel."""
    from setuptools import find_packages

    import tokenmill

    root = pathlib.Path(tokenmill.__file__).parent.parent
    found = set(find_packages(str(root), include=["tokenmill*"]))
    folders = {p.parent.relative_to(root).as_posix().replace("/", ".")
               for p in (root / "tokenmill").rglob("*.py")}
    assert folders <= found, sorted(folders - found)


def test_generate_shows_loading_progress_when_asked(tiny_models):
    """--progress prints loading's steps with their times on stderr, in the order they
    happen; without it (stderr not a terminal) they stay off the output."""
    import re

    base = [*_CLI, "generate", "--model", tiny_models("llama")[0], "--prompt", "Paris is",
            "--max-tokens", "2"]
    shown = subprocess.run([*base, "--progress"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    steps = [re.sub(r"^\[ *[\d.]+ s\] ", "", line) for line in shown.stderr.splitlines()
             if re.match(r"^\[ *[\d.]+ s\] ", line)]
    order = [next(i for i, s in enumerate(steps) if s.startswith(prefix))
             for prefix in ("loading ", "tokenizer ready", "Linear kernels", "KV cache: ")]
    assert order == sorted(order)
    assert "1.0 full contexts" in steps[order[-1]]  # one prompt: a cache for one context
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "KV cache" not in quiet.stderr
