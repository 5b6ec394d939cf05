"""`tokenmill run-batch -i requests.jsonl -o results.jsonl [serve flags]` (and `python -m
tokenmill.entrypoints.openai.run_batch`, vLLM's command): every request line of the input
answered through the engine as the server answers it (batch/lines.py), one output line per
input line, in the input's order; the engine starts and stops with the command. The output
file appears whole (written beside it, then renamed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Run a file of OpenAI batch request "
                                 "lines through a model; every other flag is `tokenmill "
                                 "serve`'s (the model, the engine's settings).")
    ap.add_argument("-i", "--input-file", required=True, help="JSONL request lines")
    ap.add_argument("-o", "--output-file", required=True, help="JSONL results (replaced)")
    ap.add_argument("--max-concurrency", type=int, default=16,
                    help="request lines in the engine at once (default 16)")
    return ap


def run(argv: list[str], prog: str = "tokenmill run-batch") -> int:
    from tokenmill.config.server import build_server_config
    from tokenmill.entrypoints.api_worker import run_event_loop
    from tokenmill.logs import configure_logging

    args, rest = _parser(prog).parse_known_args(argv)
    try:
        if args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1.")
        if not os.path.isfile(args.input_file):
            raise ValueError(f"--input-file {args.input_file!r} is not a file.")
        config = build_server_config(rest, prog=prog)
        configure_logging(config.engine.log_format, config.engine.log_level)
        counts = run_event_loop(_run(config, args))
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    logger.info("run-batch: %d lines answered (%d with a 200), %d refused as lines",
                *counts)
    return 0


async def _run(config, args) -> tuple[int, int, int]:
    from tokenmill.config.generation import sampling_defaults
    from tokenmill.engine.core_client import start_engine_core_process
    from tokenmill.entrypoints.api.state import ApiSettings, build_state
    from tokenmill.entrypoints.batch.lines import answer_all
    from tokenmill.entrypoints.serve import served_model_path
    from tokenmill.tokenizer import load_chat_template

    model_path = await asyncio.to_thread(served_model_path, config.engine)
    defaults = sampling_defaults(model_path, config.engine.generation_config,
                                 config.engine.override_generation_config)
    process, address, _ = await asyncio.to_thread(start_engine_core_process, config.engine,
                                                  model_path)
    state = None
    answered = ok = refused = 0
    partial = f"{args.output_file}.partial"
    try:
        settings = ApiSettings(config=config, engine_address=address,
                               tokenizer_path=config.engine.tokenizer or model_path,
                               model_path=model_path, sampling_defaults=defaults,
                               chat_template_text=load_chat_template(config.chat_template))
        state = await build_state(settings)
        waiting: dict[int, dict] = {}
        next_line = 1
        with open(args.input_file, "rb") as source, open(partial, "w",
                                                          encoding="utf-8") as out:
            lines = (raw for raw in source if raw.strip())
            async for number, line in answer_all(lines, state, args.max_concurrency):
                waiting[number] = line
                while next_line in waiting:  # (in the input's order)
                    done = waiting.pop(next_line)
                    out.write(json.dumps(done, ensure_ascii=False) + "\n")
                    next_line += 1
                    if done["response"] is None:
                        refused += 1
                    else:
                        answered += 1
                        ok += done["response"]["status_code"] == 200
        os.replace(partial, args.output_file)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
        if state is not None:
            await state.engine.shutdown(stop_core=True)
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
    return answered, ok, refused
