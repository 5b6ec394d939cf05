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
