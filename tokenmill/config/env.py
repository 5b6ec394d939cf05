"""The environment, read here and nowhere else: typed reads of variables with messages that
name the variable (`Env`), and the switches read outside a server's start-up (the metrics
directory, the downloader's MD5_CHECK, TRITON_INTERPRET, the hub to use, the cache folder,
torch's huge pages)."""

from __future__ import annotations

import os


class Env:
    """Typed reads of environment variables with messages that name the variable."""

    def __init__(self, environ=None) -> None:
        """`environ`: a mapping of variables (tests); None: this process's environment."""
        self.environ = os.environ if environ is None else environ

    def raw(self, *names: str) -> tuple[str, str] | None:
        for name in names:  # first given name wins
            value = self.environ.get(name)
            if value not in (None, ""):
                return name, value
        return None

    def text(self, *names: str):
        found = self.raw(*names)
        return None if found is None else found[1]

    def integer(self, *names: str):
        found = self.raw(*names)
        if found is None:
            return None
        try:
            return int(found[1])
        except ValueError:
            raise ValueError(f"Environment variable {found[0]} must be an integer, got "
                             f"{found[1]!r}.") from None

    def number(self, *names: str):
        found = self.raw(*names)
        if found is None:
            return None
        try:
            return float(found[1])
        except ValueError:
            raise ValueError(f"Environment variable {found[0]} must be a number, got "
                             f"{found[1]!r}.") from None

    def flag(self, name: str, words: bool = False):
        """0 or 1 (`words`: also true / false, any case, as vLLM reads its own)."""
        found = self.raw(name)
        if found is None:
            return None
        value = found[1].lower() if words else found[1]
        if value not in ("0", "1", *(("true", "false") if words else ())):
            raise ValueError(f"Environment variable {name} must be 0 or 1"
                             f"{' (or true / false)' if words else ''}, got {found[1]!r}.")
        return value in ("1", "true")


def cache_dir(environ=None) -> str:
    """tokenmill's cache folder (built kernels, converted GGUF tokenizers): XDG_CACHE_HOME's
    or ~/.cache's tokenmill/."""
    base = Env(environ).text("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                               ".cache")
    return os.path.join(base, "tokenmill")


def share_metrics_dir(path: str) -> None:
    """PROMETHEUS_MULTIPROC_DIR = `path`, for this process and the HTTP workers it spawns
    afterwards (inherited; prometheus_client writes its metric files there)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def huge_pages_for_torch() -> None:
    """THP_MEM_ALLOC_ENABLE=1 where it is not set: torch's CPU allocator then asks for
    transparent huge pages (madvise) for buffers of 2 MB and more, the weights among them. A
    decode step streams every weight once; on 4 KB pages the hardware prefetchers stop at
    each page's end and the TLB misses (the 2-core Zen 4: gpt-oss-shaped batch-1 decode
    5-10 % faster, resident memory the same; bench/NOTES.md). torch reads it at its first
    allocation: in effect when tokenmill is imported before torch (the `tokenmill` command,
    its workers, which inherit it); 0 keeps 4 KB pages."""
    if Env().raw("THP_MEM_ALLOC_ENABLE") is None:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"


def md5_check(environ=None) -> bool:
    """The seed downloader's MD5_CHECK=1: files present are hashed again (sha256, not md5)."""
    return bool(Env(environ).flag("MD5_CHECK"))


def triton_interpreted(environ=None) -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter (on the CPU)."""
    found = Env(environ).raw("TRITON_INTERPRET")
    return found is not None and found[1].strip().lower() in ("1", "true", "on", "yes")


def hub_source(environ=None) -> str:
    """Where hub names are looked up: "modelscope" with TOKENMILL_USE_MODELSCOPE=1 (or vLLM's
    VLLM_USE_MODELSCOPE=1), else "hf" (the Hugging Face Hub, or HF_ENDPOINT's mirror)."""
    env = Env(environ)
    vllm = env.raw("VLLM_USE_MODELSCOPE")  # (vLLM takes "true" / "True")
    return "modelscope" if env.flag("TOKENMILL_USE_MODELSCOPE") or \
        (vllm is not None and vllm[1].strip().lower() in ("1", "true")) else "hf"


# Every environment variable tokenmill reads, with the flag it stands beside ("" where there is
# none) and what it does: the configuration reference is generated from this table, and a test
# checks every variable read above and in the configuration modules is listed here.
VARIABLES: dict[str, tuple[str, str]] = {
    # the seed's server variables (PaddleNLP's start_server): flags win over them
    "MODEL_DIR": ("MODEL", "the model to serve: an HF folder, a .gguf file or a hub name"),
    "SERVICE_HTTP_PORT": ("--port", "API port (old name PUSH_MODE_HTTP_PORT, which wins)"),
    "PUSH_MODE_HTTP_PORT": ("--port", "the API port's old name"),
    "HEALTH_HTTP_PORT": ("--health-port", "health port (old name HTTP_PORT, which wins)"),
    "HTTP_PORT": ("--health-port", "the health port's old name"),
    "METRICS_HTTP_PORT": ("--metrics-port", "metrics port (old name METRICS_PORT, which wins)"),
    "METRICS_PORT": ("--metrics-port", "the metrics port's old name"),
    "SERVICE_GRPC_PORT": ("--grpc-port", "gRPC port (old name GRPC_PORT, which wins)"),
    "GRPC_PORT": ("--grpc-port", "the gRPC port's old name"),
    "INTER_PROC_PORT": ("", "PaddleNLP's queue-service port (old name INFER_QUEUE_PORT): "
                            "accepted, no effect; the engine link is a unix socket"),
    "INFER_QUEUE_PORT": ("", "INTER_PROC_PORT's old name: accepted, no effect"),
    "PUSH_MODE_HTTP_WORKERS": ("--http-workers", "API processes, 1-8"),
    "BATCH_SIZE": ("--max-num-seqs", "sequences per step (at most 256)"),
    "BLOCK_SIZE": ("--block-size", "tokens per KV block"),
    "BLOCK_BS": ("--num-kv-blocks", "KV blocks as PaddleNLP sizes them: BLOCK_BS x "
                                    "ceil(max(MAX_DEC_LEN, MAX_SEQ_LEN) / block size)"),
    "BLOCK_RATIO": ("", "checked to be in (0, 1], no effect: PaddleNLP's prefill/decode "
                        "split of the cache; tokenmill has one pool"),
    "MAX_SEQ_LEN": ("--max-seq-len", "native API: most prompt tokens"),
    "MAX_DEC_LEN": ("--max-dec-len", "native API: most new tokens, and the default"),
    "MAX_CACHED_TASK_NUM": ("--max-cached-task-num", "queued requests before 503"),
    "DTYPE": ("--dtype", "auto, float32, bfloat16, float16"),
    "USE_CACHE_KV_INT8": ("--kv-cache-dtype int8", "1: int8 K/V blocks"),
    "DISABLE_STREAMING": ("--disable-streaming", "1: stream requests are refused"),
    "USE_WARMUP": ("--use-warmup", "1: one short request before reporting ready"),
    "CHECK_HEALTH_INTERVAL": ("", "seconds without an engine heartbeat before it counts as "
                                  "dead (default 10)"),
    "VLLM_ENGINE_ITERATION_TIMEOUT_S": ("", "seconds one engine step may run before it "
                                            "counts as stalled, at the least (default 60)"),
    "FD_LOG_DIR": ("--log-dir", "where start_server writes server.log and server.pid"),
    "VLLM_API_KEY": ("--api-key", "require Authorization: Bearer KEY"),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": ("", "1 / true: /v1/load_lora_adapter and "
                                             "/v1/unload_lora_adapter serve (--enable-lora)"),
    "SPECULATE_METHOD": ("--speculative-config", "PaddleNLP's speculative decoding: "
                                                 "inference_with_reference, eagle or mtp"),
    "SPECULATE_MAX_DRAFT_TOKEN_NUM": ("--speculative-config", "draft tokens per step"),
    "SPECULATE_MAX_NGRAM_SIZE": ("--speculative-config", "ngram: longest n-gram matched"),
    "SPECULATE_MODEL_PATH": ("--speculative-config", "mtp: the checkpoint holding the MTP "
                                                     "layers"),
    "SPECULATE_MODEL_QUANT_TYPE": ("--speculative-config", "mtp: the draft layers' "
                                                           "quantization"),
    # several machines
    "MP_NUM": ("--tensor-parallel-size", "every rank (tensor x pipeline parallel)"),
    "MP_NNODE": ("--nnodes", "nodes sharing the ranks"),
    "POD_IPS": ("", "the nodes' addresses, node 0 first (a node's index is its place here)"),
    "POD_0_IP": ("--master-addr", "node 0's address (POD_IPS' first)"),
    "HOST_IP": ("", "this node's address in POD_IPS (default: the local one)"),
    "MASTER_ADDR": ("--master-addr", "node 0's rendezvous address"),
    "MASTER_PORT": ("--master-port", "node 0's rendezvous port (default 29500)"),
    "OMPI_COMM_WORLD_RANK": ("--node-rank", "this node's index under mpirun (Open MPI)"),
    "PMI_RANK": ("--node-rank", "this node's index under mpirun (MPICH, Intel MPI)"),
    "RAY_ADDRESS": ("--distributed-executor-backend ray", "the Ray cluster to join"),
    # models and hubs
    "TOKENMILL_USE_MODELSCOPE": ("--source modelscope", "1: hub names come from ModelScope"),
    "VLLM_USE_MODELSCOPE": ("--source modelscope", "vLLM's spelling of the same (true / 1)"),
    "MD5_CHECK": ("", "tokenmill download: 1 hashes files already present again"),
    # kernels (read once at start-up)
    "TOKENMILL_CPU_KERNELS": ("", "0: no compiled CPU kernels (torch ops only)"),
    "TOKENMILL_CPU_INT_DOT": ("", "0: int8/int4 layers keep float32 activations"),
    "TOKENMILL_CPU_DECODE_STEP": ("", "0: decode steps layer by layer from Python"),
    "TOKENMILL_GGUF_COMPACT": ("", "0: GGUF Q6_K and Q5 blocks widened to int8"),
    "TOKENMILL_GPU_SKINNY_LINEAR": ("", "1: 16-bit linears of small batches on Triton "
                                        "kernels"),
    "TOKENMILL_GPU_PIECEWISE_GRAPHS": ("", "0: no piecewise CUDA graphs"),
    "TOKENMILL_CPU_GRAPH_BUCKETS": ("", "1: the CUDA-graph buckets run eagerly on the CPU "
                                        "(tests)"),
    "TOKENMILL_FP8_BLOCKS": ("", "auto, keep or dequantize: how block-FP8 checkpoints load"),
    "TRITON_INTERPRET": ("", "1: Triton kernels run in Triton's interpreter (on the CPU)"),
    "CC": ("", "the C compiler of the CPU kernels (default cc)"),
    "XDG_CACHE_HOME": ("", "the cache folder's parent (built kernels, GGUF tokenizers)"),
    "THP_MEM_ALLOC_ENABLE": ("", "torch's: 1 (set where unset when tokenmill loads before "
                                 "torch) gives CPU buffers of 2 MB and more transparent huge "
                                 "pages; 0 keeps 4 KB pages"),
}
