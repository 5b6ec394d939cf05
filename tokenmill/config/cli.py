"""The `tokenmill serve` command line (argparse): flags only, no defaults applied and no
environment read here (server.py merges flags over the seed's variables and defaults); of
vLLM's flags, which have no effect here, which ask for what tokenmill does not do, and what
its CORS flags ask of the middleware."""

from __future__ import annotations


def _parse_len(text: str) -> int:
    """vLLM accepts 4096, 4k, 4K (x1000) and 4KiB-style 1ki (x1024) for --max-model-len."""
    t = text.strip().lower()
    for suffix, mult in (("ki", 1024), ("k", 1000), ("mi", 1 << 20), ("m", 1_000_000)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def make_serve_parser(prog: str = "tokenmill serve", description: str | None = None):
    import argparse

    p = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [MODEL] [OPTIONS]",
        epilog="Every option and environment variable, with its default: "
               "docs/configuration.md.",
        description=description or "Serve a model over the native, OpenAI and Triton-generate "
                    "HTTP APIs and KServe gRPC. Flags override PaddleNLP's environment "
                    "variables (MODEL_DIR, BATCH_SIZE, ...), which override defaults.")
    g = p.add_argument_group("model", "what is served and how its weights load")
    a = g.add_argument
    a("model", nargs="?", default=None,
      help="HF directory, .gguf file or hub name (env MODEL_DIR; default: the bundled "
           "SmolLM2-135M-Instruct)")
    a("--model", dest="model_flag", default=None, metavar="MODEL",
      help="same as the positional MODEL")
    a("--tokenizer", default=None, help="a tokenizer folder other than the model's")
    a("--revision", default=None, help="a hub name's branch, tag or commit (default main)")
    a("--download-dir", default=None, help="where hub names are downloaded (default: the "
      "hub cache, HF_HOME)")
    a("--served-model-name", nargs="+", default=None,
      help="names accepted in `model`; the first is reported")
    a("--dtype", default=None, help="auto, float32, bfloat16, float16 (env DTYPE); auto: "
      "float32 on a CPU, 16-bit on a GPU; bfloat16 on a CPU: bf16 weights, float32 activations")
    a("--device", default=None, help="auto, cpu, cuda[:N] (default auto: a GPU if there is one)")
    a("--max-model-len", type=_parse_len, default=None,
      help="context length (e.g. 4096, 4k; default: the model's)")
    a("--generation-config", default=None,
      help="default sampling parameters of OpenAI requests and LLM: auto (the model's "
           "generation_config.json; default), vllm (none) or a folder holding one")
    a("--override-generation-config", default=None,
      help="JSON fields over the generation config's, e.g. '{\"temperature\": 0.5}'")
    a("--seed", type=int, default=None,
      help="the engine's random seed: requests without a seed of their own draw from it "
           "(default 0)")
    a("--runner", choices=["auto", "generate", "pooling"], default=None,
      help="generate (text) or pooling (embeddings and scores: /v1/embeddings, /v1/score, "
           "/rerank); auto (default): pooling for a sentence-transformers folder, a bare "
           "decoder (`...Model`) or a `...ForSequenceClassification` checkpoint")
    a("--task", choices=["auto", "generate", "embed", "embedding", "classify", "score",
                         "reward"], default=None,
      help="vLLM's older spelling of --runner: generate, or a pooling task (embed, classify, "
           "score)")
    a("--limit-mm-per-prompt", default=None,
      help="an image-text model's images per request, as JSON: '{\"image\": 4}' (default 8)")
    a("--mmproj", default=None,
      help="a GGUF model's llama.cpp vision projector file (mmproj-*.gguf) serving its "
           "images (Gemma 3's)")
    a("--pooler-config", default=None,
      help="a pooling model's pooling over its own, as JSON: '{\"pooling_type\": \"MEAN\", "
           "\"normalize\": true}' (LAST, MEAN, CLS or MAX)")

    g = p.add_argument_group("serving", "ports, API processes, limits and request handling")
    a = g.add_argument
    a("--host", default=None, help="bind address of the HTTP and gRPC ports (default 0.0.0.0)")
    a("--port", type=int, default=None, help="API port (env SERVICE_HTTP_PORT; default 9965)")
    a("--health-port", type=int, default=None,
      help="liveness and readiness probes (env HEALTH_HTTP_PORT; default 8110; 0: any free "
           "port)")
    a("--metrics-port", type=int, default=None,
      help="Prometheus /metrics and the dashboard (env METRICS_HTTP_PORT; default 8722; 0: "
           "any free port)")
    a("--grpc-port", type=int, default=None,
      help="KServe v2 gRPC (env SERVICE_GRPC_PORT; default 8811; 0: any free port)")
    a("--api-key", default=None, help="require `Authorization: Bearer KEY` (env VLLM_API_KEY)")
    a("--http-workers", "--api-server-count", dest="http_workers", type=int, default=None,
      help="API processes (env PUSH_MODE_HTTP_WORKERS, 1-8; vLLM's --api-server-count): one "
           "streams ~28k tokens a second, a GPU's large batches need more")
    a("--max-dec-len", type=int, default=None, help="cap on new tokens (env MAX_DEC_LEN)")
    a("--max-seq-len", type=int, default=None, help="cap on prompt tokens (env MAX_SEQ_LEN)")
    a("--max-cached-task-num", type=int, default=None,
      help="queued requests before 503 (env MAX_CACHED_TASK_NUM; default 128)")
    a("--max-request-body-bytes", type=int, default=None,
      help="larger request bodies get 413 before parsing (default 2097152 = 2 MiB)")
    a("--batch-dir", default=None,
      help="the Batch API's uploaded files, results and batch records (default: "
      "~/.cache/tokenmill/batches, or under XDG_CACHE_HOME)")
    a("--max-batch-file-bytes", type=int, default=None,
      help="largest upload to /v1/files (default 209715200 = 200 MiB)")
    a("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
      help="hosts an image-text model's requests may fetch http(s) image URLs from (each "
           "redirect's too; at most 20 MiB, 10 s); default none: data URLs only")
    a("--disable-streaming", action="store_true", default=None,
      help="refuse stream requests (env DISABLE_STREAMING=1)")
    a("--stream-interval", type=int, default=None,
      help="streams send their first tokens at once, then a chunk per N new tokens, and their "
           "end at once (default 1: every step's tokens; larger: less work per token)")
    a("--use-warmup", action="store_true", default=None,
      help="run one short request before reporting ready (env USE_WARMUP=1)")
    a("--shutdown-timeout", type=float, default=None,
      help="seconds SIGTERM waits for in-flight requests (default 300); 0 ends them at once")

    g = p.add_argument_group("scheduling and memory", "the batch, the KV cache and its budget")
    a = g.add_argument
    a("--max-num-seqs", type=int, default=None,
      help="concurrent sequences (env BATCH_SIZE; default 256)")
    a("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    a("--block-size", type=int, default=None, help="KV block tokens (env BLOCK_SIZE; default 16)")
    a("--kv-cache-memory", type=float, default=None, metavar="GIB",
      help="KV blocks' memory, the machine's, split across the ranks on it (default on the "
           "CPU: enough for --max-num-seqs full contexts, at most 4 GiB and a quarter of free "
           "memory; on a GPU it overrides --gpu-memory-utilization)")
    a("--gpu-memory-utilization", type=float, default=None,
      help="GPU: the share of the card's memory weights, activations and KV blocks may use "
           "(default 0.9)")
    a("--num-kv-blocks", type=int, default=None, help="exact KV block count (env BLOCK_BS)")
    a("--kv-cache-dtype", default=None,
      choices=["auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3"],
      help="auto: the model's dtype (bfloat16 under --dtype bfloat16, on a CPU too); "
           "float32 / bfloat16: K/V in that dtype (on a GPU: the model's own); int8: int8 K/V "
           "cache (env USE_CACHE_KV_INT8=1); fp8: float8 e4m3 K/V")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="reuse the KV blocks of a prompt prefix already computed (default on)")
    a("--kv-cache-disk-dir", default=None, metavar="DIR",
      help="a disk tier for the prefix cache: full KV blocks written to DIR and read back on "
           "a prefix hit, across restarts and shared by this machine's replicas (one rank; "
           "no speculative decoding or --async-scheduling)")
    a("--kv-cache-disk-gib", type=float, default=None, metavar="GIB",
      help="the disk tier's bound (default 10): least recently used blocks go first")
    a("--kv-offloading-size", type=float, default=None, metavar="GIB",
      help="a host-memory tier for the prefix cache, for an engine whose KV cache is on a GPU "
           "(vLLM's flag): full blocks kept in GIB of host memory and read back on a prefix "
           "hit (in front of --kv-cache-disk-dir if both are given)")
    a("--kv-offloading-backend", default=None, choices=["native"],
      help="the host-memory tier's implementation (vLLM's flag; native only)")
    a("--kv-transfer-config", default=None, metavar="JSON",
      help='prefill/decode disaggregation over NIXL, e.g. \'{"kv_connector":"NixlConnector",'
           '"kv_role":"kv_both"}\' (vLLM\'s flag; one rank; `tokenmill disagg-proxy` in front)')
    a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
      help="prompts split across steps by the token budget (default on)")
    a("--async-scheduling", action="store_true", default=None,
      help="schedule the next step while the current one runs (no pipeline stages, no drafts)")
    a("--enable-sleep-mode", action="store_true", default=None,
      help="POST /sleep, /wake_up: free the KV cache (level 1) and the weights (level 2) "
           "while idle")
    a("--tenant-weights", default=None, metavar="NAME=W,...",
      help="--scheduling-policy fair: each tenant's weight (name=weight list or a JSON "
           "object; a tenant not named has weight 1)")
    a("--tenant-header", default=None,
      help="the header naming a request's tenant (default X-Tenant-Id; without it: the "
           "request's API key, else 'default')")
    a("--max-queue-time", type=float, default=None, metavar="SECONDS",
      help="a request may wait this long to start: one expected to wait longer is refused "
           "at once, one that did is refused then (429 with Retry-After; default no limit; "
           "a request's X-Max-Queue-Time header may ask for less)")
    a("--attention-backend", default=None, choices=["auto", "torch", "triton"],
      help="auto: triton on GPUs, torch on the CPU")
    a("--enforce-eager", action="store_true", default=None,
      help="GPU: run decode steps op by op (no CUDA graphs)")

    g = p.add_argument_group("parallelism", "ranks on this machine and across nodes")
    a = g.add_argument
    a("--tensor-parallel-size", "-tp", type=int, default=None,
      help="ranks that split every layer (env MP_NUM; default 1)")
    a("--pipeline-parallel-size", "-pp", type=int, default=None,
      help="stages the layers are split into (MP_NUM then counts tp x pp ranks)")
    a("--data-parallel-size", "-dp", type=int, default=None,
      help="engine replicas behind the API (each with its own tensor/pipeline ranks)")
    a("--enable-expert-parallel", action="store_true", default=None,
      help="each tensor-parallel rank holds whole experts (1/tp of them) instead of a "
           "slice of every one")
    a("--distributed-executor-backend", default=None, choices=["mp", "ray"],
      help="mp: the ranks as processes on this node (and --nnodes); ray: as actors on the "
           "Ray cluster (RAY_ADDRESS, or the local one)")
    a("--distributed-timeout", type=float, default=None, metavar="S",
      help="seconds start-up waits for every rank to join (default 120)")
    a("--nnodes", type=int, default=None, help="nodes sharing the ranks (env MP_NNODE)")
    a("--node-rank", type=int, default=None,
      help="this node's index (default: from POD_IPS, OMPI_COMM_WORLD_RANK or PMI_RANK)")
    a("--master-addr", default=None,
      help="node 0's address: its rendezvous (env MASTER_ADDR, else POD_0_IP)")
    a("--master-port", type=int, default=None,
      help="node 0's rendezvous port (env MASTER_PORT; default 29500)")

    g = p.add_argument_group("quantization and speculative decoding")
    a = g.add_argument
    a("--quantization", "-q", default=None,
      help="int8, int4, a8w8 or fp8 (also weight_only_int8, weight_only_int4); default: as the "
           "checkpoint is")
    a("--speculative-config", default=None,
      help="JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (env "
           "SPECULATE_METHOD, SPECULATE_*)")

    g = p.add_argument_group("LoRA adapters")
    a = g.add_argument
    a("--enable-lora", action="store_true", default=None,
      help="serve LoRA adapters (PEFT folders) beside the base model")
    a("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
      help="adapters served by name (the OpenAI `model` field), NAME=PATH or JSON "
           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    a("--max-loras", type=int, default=None, help="adapters in one step (default 1)")
    a("--max-lora-rank", type=int, default=None, help="highest adapter rank (default 16)")
    a("--max-cpu-loras", type=int, default=None,
      help="adapters kept read in host memory (default: --max-loras)")

    g = p.add_argument_group("chat, tools and outputs")
    a = g.add_argument
    a("--chat-template", default=None, metavar="FILE|TEMPLATE",
      help="a Jinja chat template (a file, or the template's text) in place of the "
           "tokenizer's, for every route that renders messages")
    a("--trust-request-chat-template", action="store_true", default=None,
      help="accept a `chat_template` in chat requests (rendered sandboxed; default: 400)")
    a("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "deepseek_v3",
                                     "pythonic", "kimi_k2", "granite", "qwen3_coder", "glm45",
                                     "openai"],
      help="chat: tool calls read from the output (enables tool_choice auto; default: the "
           "parser the chat template's tool format names, when it names one)")
    a("--enable-auto-tool-choice", action="store_true", default=None,
      help="accepted for vLLM's command lines: --tool-call-parser alone enables auto")
    a("--reasoning-parser", choices=["deepseek_r1", "qwen3", "glm45", "granite", "gpt_oss"],
      help="chat: the thinking section (<think> ... </think>; Granite's phrases) goes to "
           "reasoning_content")
    a("--enable-reasoning", action="store_true", default=None,
      help="accepted for vLLM's command lines: --reasoning-parser alone enables the split")
    a("--max-logprobs", type=int, default=None,
      help="most logprobs / top_logprobs a request may ask for (default and at most 20)")
    a("--guided-decoding-backend", default=None,
      help="auto or xgrammar (structured outputs run on xgrammar)")
    a("--response-role", default=None, help="chat responses' role (default assistant)")
    a("--return-tokens-as-token-ids", action="store_true", default=None,
      help="OpenAI logprobs show tokens as token_id:N")
    a("--enable-prompt-tokens-details", action="store_true", default=None,
      help="OpenAI usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)")

    g = p.add_argument_group("logging and observability")
    a = g.add_argument
    a("--log-level", choices=["debug", "info", "warning", "error"], default=None,
      help="default info; debug also prints tracebacks of start-up failures")
    a("--log-format", choices=["text", "json"], default=None,
      help="log lines as text (default) or one JSON object each")
    a("--log-dir", default=None, help="where log files go (env FD_LOG_DIR; default log)")
    a("--log-requests", action="store_true", default=None,
      help="access lines carry the prompt and output text (default: counts only)")
    a("--otlp-traces-endpoint", default=None, metavar="URL",
      help="export one OpenTelemetry span per request over OTLP/HTTP (e.g. "
           "http://collector:4318/v1/traces)")
    a("--enable-request-id-headers", action="store_true", default=None,
      help="responses carry X-Request-Id (the request's own, or a new one)")
    a("--enable-server-load-tracking", action="store_true", default=None,
      help="GET /load answers {\"server_load\": requests in flight}")

    g = p.add_argument_group("HTTP front end", "the API app's options (vLLM's flags)")
    a = g.add_argument
    a("--disable-fastapi-docs", action="store_true", default=None,
      help="no /docs, /redoc or /openapi.json on the API port")
    a("--root-path", default=None, help="the path prefix a proxy serves the API under")
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
        a(flag, default=None, help="CORS: a JSON list (default: no CORS headers at all)")
    a("--allow-credentials", action="store_true", default=None, help="CORS: allow credentials")
    _vllm_flags(p.add_argument_group(
        "vLLM compatibility", "vLLM's flags its deployment guides pass: accepted with no "
        "effect (logged once at start-up), or refused where they ask for what tokenmill does "
        "not do").add_argument, argparse)
    return p


def _vllm_flags(a, argparse) -> None:
    """vLLM's flags, so its command lines run unchanged: those accepted with no effect (logged
    once at start-up) or refused where they ask for what tokenmill does not do."""
    a("--scheduling-policy", choices=["fcfs", "priority", "fair"], default=None,
      help="fcfs (arrival order, the default), priority (each request's `priority`, lower "
      "first; lower-priority work is preempted first when memory or slots are short) or fair "
      "(tenants share the tokens by --tenant-weights)")
    a("--num-scheduler-steps", type=int, default=None, help="no effect")
    a("--trust-remote-code", action="store_true", default=None,
      help="accepted; no code from a model folder is run")
    a("--disable-async-output-proc", action="store_true", default=None, help="no effect")
    a("--disable-log-requests", action="store_true", default=None, help="no effect")
    a("--disable-log-stats", action="store_true", default=None, help="no effect")
    a("--swap-space", type=float, default=None, help="no effect")
    a("--preemption-mode", choices=["recompute", "swap"], default=None,
      help="no effect: preempted requests are recomputed")
    a("--max-seq-len-to-capture", type=int, default=None, help="no effect")
    a("--uvicorn-log-level", default=None, help="no effect: see --log-level")
    a("--disable-frontend-multiprocessing", action="store_true", default=None,
      help="no effect")
    a("--load-format", default=None, help="auto, safetensors or gguf (as the files are)")
    a("--tokenizer-mode", default=None, help="auto or slow: no effect (the tokenizer loads as "
      "transformers picks it)")
    a("--compilation-config", "-O", default=None, help="no effect")
    a("--additional-config", default=None, help="no effect (vllm-ascend)")
    a("--multi-step-stream-outputs", nargs="?", const="True", default=None,
      help="no effect")
    for name, why in REFUSED_FLAGS.items():
        a("--" + name.replace("_", "-"), nargs="*", default=None, help=f"refused: {why}")


_TLS = "terminate TLS in front of the server (a proxy or load balancer)"
REFUSED_FLAGS = {  # vLLM's flags refused whatever their value: why
    "middleware": "the server runs no code named on its command line",
    "hf_overrides": "a model's config is read as it is",
    "ssl_keyfile": _TLS, "ssl_certfile": _TLS, "ssl_ca_certs": _TLS, "ssl_cert_reqs": _TLS,
}
IGNORED_FLAGS = {  # vLLM's flags accepted with no effect: (flag, why), logged at start-up
    "num_scheduler_steps": ("--num-scheduler-steps", "every step is scheduled anew"),
    "trust_remote_code": ("--trust-remote-code", "tokenmill never runs a checkpoint's own "
                          "code; it serves the architectures it implements"),
    "disable_async_output_proc": ("--disable-async-output-proc",
                                  "outputs are processed in the API process already"),
    "enable_reasoning": ("--enable-reasoning", "--reasoning-parser alone turns the split on"),
    "disable_log_requests": ("--disable-log-requests",
                             "request texts are logged only with --log-requests"),
    "disable_log_stats": ("--disable-log-stats", "no periodic stats lines are logged; "
                          "they are on the metrics port"),
    "swap_space": ("--swap-space", "preempted requests are recomputed, never swapped"),
    "preemption_mode": ("--preemption-mode", "preempted requests are recomputed"),
    "max_seq_len_to_capture": ("--max-seq-len-to-capture",
                               "CUDA graphs hold decode steps of any context length"),
    "uvicorn_log_level": ("--uvicorn-log-level", "every log follows --log-level"),
    "disable_frontend_multiprocessing": ("--disable-frontend-multiprocessing",
                                         "the API runs in its own process (--http-workers)"),
    "load_format": ("--load-format", "weights load as their files are (safetensors, GGUF)"),
    "tokenizer_mode": ("--tokenizer-mode", "the tokenizer loads as transformers picks it"),
    "compilation_config": ("--compilation-config", "GPU decode steps run as CUDA graphs "
                           "captured per batch size (--enforce-eager turns them off)"),
    "additional_config": ("--additional-config", "vllm-ascend's options"),
    "multi_step_stream_outputs": ("--multi-step-stream-outputs", "every step is scheduled "
                                  "anew (see --stream-interval)"),
}


def check_vllm_flags(args) -> None:
    """vLLM's flags that ask for what tokenmill does not do: refused, naming the flag."""
    if args.enable_reasoning and not args.reasoning_parser:
        raise ValueError("--enable-reasoning needs --reasoning-parser (deepseek_r1, qwen3, "
                         "glm45, granite or gpt_oss).")
    for name, why in REFUSED_FLAGS.items():
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is refused: {why}.")
    if args.load_format not in (None, "auto", "safetensors", "gguf"):
        raise ValueError(f"--load-format {args.load_format!r} is not available: weights load "
                         "from safetensors or GGUF files (never pickles).")
    if args.tokenizer_mode not in (None, "auto", "slow", "hf"):
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode!r} is not available: the "
                         "tokenizer loads through transformers (auto).")
    if args.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise ValueError(f"--guided-decoding-backend {args.guided_decoding_backend!r} is not "
                         "available: structured outputs run on xgrammar (auto or xgrammar).")


def cors_arguments(args) -> dict | None:
    """vLLM's CORS flags as CORSMiddleware's arguments (JSON lists; unset ones "*"), or None
    when none is given (then no CORS headers are sent)."""
    import json

    names = ("allowed_origins", "allowed_methods", "allowed_headers")
    if all(getattr(args, n) is None for n in names) and not args.allow_credentials:
        return None
    cors = {"allow_credentials": bool(args.allow_credentials)}
    for name in names:
        text = getattr(args, name)
        try:
            value = ["*"] if text is None else json.loads(text)
        except ValueError:
            value = None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"--{name.replace('_', '-')} takes a JSON list of strings, e.g. "
                             f"'[\"https://example.com\"]', got {text!r}.")
        cors[name.replace("allowed", "allow")] = value
    return cors
