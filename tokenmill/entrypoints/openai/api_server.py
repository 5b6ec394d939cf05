"""`python -m tokenmill.entrypoints.openai.api_server ...` is `tokenmill serve ...`: vLLM's
deployment command lines (`python -m vllm.entrypoints.openai.api_server --model M ...`) run
with only the package name changed."""

from __future__ import annotations

import sys

from tokenmill.entrypoints.cli import cmd_serve


def main(argv: list[str] | None = None) -> int:
    return cmd_serve(sys.argv[1:] if argv is None else argv,
                     prog="python -m tokenmill.entrypoints.openai.api_server")


if __name__ == "__main__":
    sys.exit(main())
