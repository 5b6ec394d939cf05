"""What the benchmarks share: the host-cost ones' command line (`--batch`, `--lengths`,
`--out`) and the long-prompt ones' (`--prompt`, `--rounds`) with their prompts; a result
file with how it was made (the command, date, machine, CPU count and git commit beside the
script's own fields); a free loopback port for the servers the serving benchmarks start."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys


def free_port() -> int:
    """A loopback port free right now (the system's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_commit(tree: str | None = None) -> str:
    """The checkout's commit, " (modified)" after it when tracked files differ from it
    (`tree`: a checkout's folder; None: this repository's; "" outside git)."""
    tree = tree or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True,
                              timeout=60).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return commit + (" (modified)" if commit and dirty else "")


def save(path: str, **fields) -> None:
    script = os.path.relpath(sys.argv[0], os.path.join(os.path.dirname(__file__), ".."))
    record = {"command": " ".join(["python", script, *sys.argv[1:]]),
              "date": datetime.date.today().isoformat(),
              "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "commit": tree_commit(), **fields}  # (before the file
    with open(path, "w") as f:  # is opened: a result file rewritten is a tracked change)
        json.dump(record, f, indent=1)


def parser(doc: str, batch: int, lengths: str) -> argparse.ArgumentParser:
    """`--batch` requests at each context length of `--lengths`, results to `--out`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lengths", default=lengths, help="comma-separated context lengths")
    ap.add_argument("--out", help="a JSON result file")
    return ap


def prompt_parser(doc: str, prompt: int = 2000, rounds: int = 3) -> argparse.ArgumentParser:
    """The long-prompt benchmarks' flags: `--model` (default the bundled one), `--prompt`
    tokens, `--rounds` prompts, results to `--out`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=prompt, help="tokens a prompt holds")
    ap.add_argument("--rounds", type=int, default=rounds, help="prompts timed (the median)")
    ap.add_argument("--out", help="a JSON result file")
    return ap


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids that share no prefix (ids 100-29,999)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(n)]
