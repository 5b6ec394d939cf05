"""A GGUF file's tokenizer and chat template, built by transformers from the file's metadata
and kept as a tokenizer folder in a cache (only where it reads back alike)."""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenmill.loading.file_checks import check_gguf

logger = logging.getLogger(__name__)


def load_gguf_tokenizer(path: str) -> Any:
    """The fast tokenizer and chat template from the GGUF metadata, built by transformers
    (seconds: it parses the whole vocabulary) and kept as a tokenizer folder in the cache, so
    the next start of the same file reads that (a fraction of a second)."""
    from transformers import AutoTokenizer

    check_gguf(path)  # (transformers reads the metadata with gguf's trusting reader)
    folder = _tokenizer_cache(path)
    if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        except (OSError, ValueError):
            logger.warning("the cached tokenizer in %s does not load: building it again", folder)
    tokenizer = _build_gguf_tokenizer(path)
    if folder is not None:
        import contextlib
        import shutil
        import tempfile

        try:
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
            tokenizer.save_pretrained(tmp)
            if _reads_back_alike(tokenizer, tmp):
                # (whole, or not at all: another process may be writing the same one)
                with contextlib.suppress(OSError):
                    os.rename(tmp, folder)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:  # a read-only cache: every start builds it
            logger.info("tokenizer not cached (%s)", exc.strerror or exc)
    return tokenizer


# Text that exercises what a saved tokenizer can lose: spaces (leading, repeated), tabs and
# newlines, accents, CJK and emoji (byte fallback), digits.
_PROBE = " Hello  world\t1234\nÉmigré naïve 東京 🙂 end"


def _reads_back_alike(tokenizer, folder: str) -> bool:
    """Whether the tokenizer saved in `folder` loads and encodes, decodes and renders a chat
    as `tokenizer` does: transformers' save and load of a tokenizer built from GGUF metadata
    does not always round-trip (a SentencePiece vocabulary can come back without its unknown
    token), and such a one is not cached."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        ids = tokenizer.encode(_PROBE)
        same = (type(loaded) is type(tokenizer) and len(loaded) == len(tokenizer)
                and loaded.encode(_PROBE) == ids and loaded.decode(ids) == tokenizer.decode(ids)
                and loaded.all_special_ids == tokenizer.all_special_ids
                and loaded.chat_template == tokenizer.chat_template)
    except Exception:  # noqa: BLE001 (any failure to read it back: not cached)
        return False
    if not same:
        logger.info("the tokenizer does not read back alike from a saved copy: not cached")
    return same


def _tokenizer_cache(path: str) -> str | None:
    """The cache folder of this file's tokenizer: keyed by the file (path, size, mtime) and
    the transformers version that built it."""
    import hashlib

    import transformers

    from tokenmill.config.env import cache_dir

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
           "|checked")  # (only copies that read back alike are written)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), "gguf-tokenizers", digest)


def _build_gguf_tokenizer(path: str) -> Any:
    """transformers builds the fast tokenizer and chat template from the GGUF metadata. For
    an architecture whose GGUF config transformers does not read (DeepSeek's `deepseek2`;
    gpt-oss, whose rope keys its reader fails on),
    the tokenizer is built from the same metadata by transformers' GGUF tokenizer reader
    alone (it does not depend on the architecture's config)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                             gguf_file=os.path.basename(path),
                                             trust_remote_code=False)
    except TypeError:
        pass  # (transformers 5.24 misreads gpt-oss' rope.scaling keys: its config reader)
    except ValueError as exc:
        if "not supported yet" not in str(exc):
            raise
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)
