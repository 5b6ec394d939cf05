"""The environment, read here and nowhere else: typed reads of variables with messages that
name the variable (`Env`), and the switches read outside a server's start-up (the metrics
directory, the downloader's MD5_CHECK, TRITON_INTERPRET, the hub to use, the cache folder)."""

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

    def flag(self, name: str):
        found = self.raw(name)
        if found is None:
            return None
        if found[1] not in ("0", "1"):
            raise ValueError(f"Environment variable {name} must be 0 or 1, got {found[1]!r}.")
        return found[1] == "1"


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
