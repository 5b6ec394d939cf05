"""`tokenmill download`: fetch a model from a hub (see hub/fetch.py), with the seed
downloader's flags accepted too (`--model_name NAME --dir D --nnodes N --mode master|slave
--speculate_model_path P`, `MD5_CHECK=1`); on several nodes a pre-sharded checkpoint's node
share only."""

from __future__ import annotations

import argparse
import sys


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill download",
        description="Download what the engine loads of a hub model (config, safetensors or "
                    "one GGUF file, tokenizer, chat template), resuming an interrupted run and "
                    "verifying sizes and hashes; prints where the model is. HF_ENDPOINT, "
                    "HF_TOKEN, HF_HUB_OFFLINE and HF_HOME apply.")
    a = p.add_argument
    a("model", nargs="?", default=None, help="ORG/NAME (a seed name ORG/NAME/<precision> is "
                                              "accepted: the precision applies when serving)")
    a("--model_name", "--model-name", dest="model_name", default=None,
      help="the seed downloader's name for MODEL")
    a("--revision", default=None, help="branch, tag or commit (default main)")
    a("--dir", "--local-dir", dest="dir", default=None,
      help="download into this folder (default: the hub cache, HF_HOME); with --model_name "
           "(the seed's form) into DIR/ORG/NAME, DIR defaulting to downloads")
    a("--include", nargs="+", default=None, metavar="GLOB", help="also fetch these files")
    a("--exclude", nargs="+", default=None, metavar="GLOB", help="leave these files out")
    a("--gguf-file", default=None, help="the GGUF file to fetch from a GGUF repository")
    a("--gguf-quant", default=None, help="the GGUF file whose name has this (e.g. Q4_K_M)")
    a("--source", choices=["hf", "modelscope"], default=None,
      help="the hub: hf (Hugging Face, HF_ENDPOINT for a mirror) or modelscope (pip install "
           "'tokenmill[modelscope]'; MODELSCOPE_ENDPOINT); default hf, or modelscope with "
           "TOKENMILL_USE_MODELSCOPE=1 / VLLM_USE_MODELSCOPE=true")
    a("--nnodes", type=int, default=1, help="nodes the model is served on: of a checkpoint "
                                             "pre-sharded by `tokenmill convert --tp-size`, "
                                             "each node fetches only its ranks' files (any "
                                             "other: all of it)")
    a("--mode", choices=["master", "slave"], default="master",
      help="seed: this node's role (master = node 0; slave = node 1 of 2)")
    a("--node-rank", type=int, default=None, help="this node's index (past 2 nodes; like "
                                                   "`tokenmill serve --node-rank`)")
    a("--speculate_model_path", "--speculate-model-path", dest="speculate_model_path",
      default=None, help="seed: where the MTP model goes (a link to the model: its MTP "
                         "layers are in its own checkpoint)")
    return p


def run(argv: list[str]) -> int:
    import os

    from tokenmill.config.env import hub_source, md5_check
    from tokenmill.config.model_names import split_precision
    from tokenmill.hub.download import HubError
    from tokenmill.hub.fetch import fetch

    args = make_parser().parse_args(argv)
    args.source = args.source or hub_source()
    name = args.model or args.model_name
    if name is None:
        sys.stderr.write("error: give the model: tokenmill download ORG/NAME\n")
        return 2
    try:
        node = _node(args)
        repo, precision = split_precision(name)
        # hf style: exactly --dir (default: the hub cache); the seed's: <dir>/<ORG/NAME>
        where = args.dir if args.model and not args.model_name \
            else os.path.join(args.dir or "downloads", repo)
        path = fetch(repo, args.revision, local_dir=where, gguf_file=args.gguf_file,
                     gguf_quant=args.gguf_quant, include=args.include, exclude=args.exclude,
                     recheck=md5_check(), node=node, source=args.source)
        sys.stdout.write(path + "\n")
        if precision:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in precision.items())
            sys.stderr.write(f"serve it at {name.rsplit('/', 1)[1]}: tokenmill serve {path} "
                             f"{flags} (or tokenmill serve {name})\n")
        if args.speculate_model_path:
            # MTP layers are part of the model's own checkpoint: the seed's
            # SPECULATE_MODEL_PATH then names the model itself
            target = args.speculate_model_path
            if not os.path.exists(target):
                os.symlink(os.path.abspath(path), target)
            sys.stderr.write(f"{target} -> {path} (MTP layers are read from the model's own "
                             "checkpoint)\n")
    except (HubError, ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0


def _node(args) -> tuple[int, int] | None:
    if args.nnodes < 1:
        raise ValueError("--nnodes must be at least 1.")
    if args.nnodes == 1:
        return None
    rank = args.node_rank
    if rank is None:
        if args.mode == "slave" and args.nnodes > 2:
            raise ValueError(f"--mode slave of {args.nnodes} nodes: give this node's "
                             "--node-rank.")
        rank = 0 if args.mode == "master" else 1
    if not 0 <= rank < args.nnodes:
        raise ValueError(f"--node-rank {rank} is not one of the {args.nnodes} nodes (0.."
                         f"{args.nnodes - 1}).")
    return rank, args.nnodes
