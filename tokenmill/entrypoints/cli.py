"""The `tokenmill` command: serve a model, generate text, quantize a model, or run a
benchmark."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.entrypoints.api.defaults import CLI


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: bundled SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length in tokens (default: the model's)")
    parser.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                        help="CPU memory for the KV cache in GiB (default 4)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the engine's random seed (vLLM's --seed): requests without a "
                             "seed of their own draw from it")
    parser.add_argument("--quantization", "-q", default=None, help="int8, int4, a8w8, fp8")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "int8"],
                        help="auto: the model's dtype; float32 / bfloat16: K/V in that dtype "
                             "(bf16: half of fp32's memory); int8: K/V in int8 with a scale "
                             "per row and head (half the memory of bf16, a quarter of fp32)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len, "seed": args.seed,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory_gib"] = args.kv_cache_memory
    return kwargs


def _show_progress(enabled: bool | None) -> None:
    """Loading's steps on stderr, each with the seconds since start (a terminal by default:
    the first run of a model takes a while, and this says where)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return

    class Elapsed(logging.Formatter):
        def format(self, record):
            return f"[{record.relativeCreated / 1000:5.1f} s] {record.getMessage()}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Elapsed())
    root = logging.getLogger("tokenmill")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def cmd_generate(args: argparse.Namespace) -> int:
    _show_progress(args.progress)
    from tokenmill import LLM, SamplingParams

    # One prompt: a KV cache for one full context (not a batch's), so it is quick to set up.
    llm = LLM(args.model, max_num_seqs=1, **_engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    sys.stdout.write(outputs[0].outputs[0].text + "\n")
    return 0


def _run_bench_script(name: str, argv: list[str]) -> int:
    """Benchmarks live in the repository's bench/ folder (they compare against other
    engines, so they are not part of the installed package)."""
    import runpy
    from pathlib import Path

    import tokenmill

    script = Path(tokenmill.__file__).resolve().parent.parent / "bench" / name
    if not script.is_file():
        sys.stderr.write(f"error: {script} not found; run from a source checkout.\n")
        return 2
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_serve(argv: list[str], prog: str = "tokenmill serve") -> int:
    from tokenmill.config.server import build_server_config

    try:
        config = build_server_config(argv, prog=prog)
        from tokenmill.entrypoints.serve import run_server
        return run_server(config)
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


def cmd_quantize(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tokenmill.convert.quantize import run

    try:
        return run(argv)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The `tokenmill` command's parser (serve, quantize, download and convert parse their own
    flags; here they are listed for --help)."""
    from tokenmill import __version__

    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the HTTP server (see `tokenmill serve --help`)")
    sub.add_parser("quantize", help="write a quantized copy of a model (see `tokenmill "
                   "quantize --help`)")
    sub.add_parser("download", help="fetch a model from a hub (see `tokenmill download "
                   "--help`)")
    sub.add_parser("convert", help="HF <-> GGUF (see `tokenmill convert --help`)")
    sub.add_parser("disagg-proxy", help="one OpenAI endpoint over prefill and decode "
                   "instances (see `tokenmill disagg-proxy --help`)")
    sub.add_parser("run-batch", help="answer a JSONL file of OpenAI batch requests (see "
                   "`tokenmill run-batch --help`)")

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the text to continue (or, with --chat, "
                     "the user's message)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=CLI["max_tokens"],
                     help=f"most tokens to generate (default {CLI['max_tokens']})")
    gen.add_argument("--temperature", type=float, default=CLI["temperature"],
                     help=f"0: greedy (default {CLI['temperature']})")
    gen.add_argument("--top-p", type=float, default=CLI["top_p"],
                     help=f"nucleus sampling's probability mass (default {CLI['top_p']})")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="this prompt's own seed (SamplingParams.seed): the same seed, the "
                          "same sample, whatever --seed is")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="print loading's steps with their times on stderr (default: when "
                          "stderr is a terminal)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="offline throughput vs transformers",
                                   add_help=False)
    offline.set_defaults(func=None)
    compare = bench_sub.add_parser("compare", help="tokenmill vs vLLM-CPU, llama.cpp and "
                                   "transformers on this machine", add_help=False)
    compare.set_defaults(func=None)
    serve_load = bench_sub.add_parser("serve", help="streaming load (closed loop, --duration or "
                                      "--request-rate-ramp) against a running OpenAI-compatible "
                                      "or native server", add_help=False)
    serve_load.set_defaults(func=None)
    quant = bench_sub.add_parser("quant", help="quantization methods: perplexity, speed and "
                                 "memory against fp32", add_help=False)
    quant.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":  # its flags live with the server config
        return cmd_serve(argv[1:])
    if argv and argv[0] == "quantize":
        return cmd_quantize(argv[1:])
    if argv and argv[0] == "download":
        from tokenmill.hub.cli import run
        return run(argv[1:])
    if argv and argv[0] == "run-batch":  # (its engine flags are serve's)
        from tokenmill.entrypoints.batch.run_batch import run as run_batch
        return run_batch(argv[1:])
    if argv and argv[0] == "disagg-proxy":
        from tokenmill.entrypoints.disagg_proxy import run as run_proxy
        return run_proxy(argv[1:])
    if argv and argv[0] == "convert":
        from tokenmill.convert.cli import run as convert
        return convert(argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        script = {"offline": "offline_throughput.py", "compare": "compare.py",
                  "serve": "serve_load.py", "quant": "quantization.py"}
        return _run_bench_script(script[args.bench_command], rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
