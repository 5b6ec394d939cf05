"""`python -m tokenmill.entrypoints.openai.run_batch -i in.jsonl -o out.jsonl --model M` is
`tokenmill run-batch ...`: vLLM's batch command line with only the package name changed."""

from __future__ import annotations

import sys

from tokenmill.entrypoints.batch.run_batch import run


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv,
               prog="python -m tokenmill.entrypoints.openai.run_batch")


if __name__ == "__main__":
    sys.exit(main())
