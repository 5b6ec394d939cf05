"""Compiling what a request asks for into an xgrammar grammar for one tokenizer, with
xgrammar's own cache (by grammar text). Bad input -> `InvalidParameter` naming the field,
in our words (xgrammar's messages carry its source paths).

Fixed here, not copied (xgrammar 0.2.8), so that every output is valid JSON in valid UTF-8:
- a JSON-schema string with `minLength` / `maxLength` takes characters `[^"\\\r\n]`: raw
  control characters (U+0000-U+001F) get in and no escape does; rewritten to JSON's string
  character (no control character, or an escape);
- JSON string characters admit the surrogate code points U+D800-U+DFFF, whose 3-byte
  encodings are not UTF-8 (random weights emit them); excluded.
JSON-schema and `json_object` grammars both go through `fix_json_ebnf`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from typing import Any

from tokenmill.sampling_params import InvalidParameter, StructuredOutputsParams
from tokenmill.structured_output.bounds import check_bounds

# character classes as xgrammar prints them
_LOOSE_CHAR = r'[^\"\\\r\n]'
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'
COMPILE_TIMEOUT_S = 10.0  # the API's bound on one grammar's compile
# Constraints this long or shorter (a `choice`, a short regex) compile on a thread of their
# own, never behind a long schema (CompileLanes).
LIGHT_SPEC_CHARS = 1024
_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
         "choice": "list of choices", "json_object": "JSON grammar"}


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidParameter("structured_outputs", "Structured outputs need xgrammar: "
                               "pip install 'tokenmill[structured]'.") from None
    return xgrammar


def fix_json_ebnf(ebnf: str) -> str:
    """xgrammar's JSON EBNF with its string characters fixed (module docstring)."""
    ebnf = ebnf.replace(_STRING_CHAR, _JSON_CHAR)
    if _LOOSE_CHAR in ebnf:
        if "basic_escape ::=" not in ebnf:
            raise RuntimeError("xgrammar's JSON EBNF changed: no basic_escape rule")
        ebnf = ebnf.replace(_LOOSE_CHAR, f'({_JSON_CHAR} | "\\\\" basic_escape)')
    return ebnf


def json_schema_ebnf(schema: str) -> str:
    """The EBNF xgrammar makes of `schema` (compact separators), strings fixed."""
    xgr = _xgrammar()
    return fix_json_ebnf(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                                          strict_mode=True)))


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """One model's compiler: `compile(params)` -> an xgrammar CompiledGrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 threads: int = 1) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, spec = params.key()
        check_bounds(kind, spec)
        compiler = self.compiler
        if kind == "json":
            try:
                json.loads(spec)
            except ValueError:
                raise InvalidParameter("json", "json is not valid JSON text.") from None
        try:
            if kind == "json":
                return compiler.compile_grammar(json_schema_ebnf(spec))
            if kind == "json_object":  # (as the schema of any object: compact, fixed)
                return compiler.compile_grammar(json_schema_ebnf('{"type": "object"}'))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice))
            return compiler.compile_grammar(spec)
        except Exception as exc:  # noqa: BLE001 - whatever the library refuses is the spec's fault
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            reason = reason.rsplit(": ", 1)[-1] if "/" in reason else reason
            raise InvalidParameter(kind, f"{kind} is not a valid or supported {_WHAT[kind]}"
                                   + (f": {reason[:200]}" if reason else ".")) from None


class CompileLanes:
    """Where grammars compile: one thread for short constraints (up to LIGHT_SPEC_CHARS) and
    one for the rest, so a few long schemas compiling never hold up a `choice` or a short
    regex (each lane runs one compile at a time: xgrammar's compile cannot be interrupted,
    and two threads are what a small machine spares beside the engine)."""

    def __init__(self, name: str) -> None:
        self._light = concurrent.futures.ThreadPoolExecutor(1, f"{name}-light")
        self._heavy = concurrent.futures.ThreadPoolExecutor(1, f"{name}-heavy")

    def submit(self, params: StructuredOutputsParams, fn, *args) -> concurrent.futures.Future:
        light = len(params.key()[1]) <= LIGHT_SPEC_CHARS
        return (self._light if light else self._heavy).submit(fn, *args)

    def shutdown(self) -> None:
        for pool in (self._light, self._heavy):
            pool.shutdown(wait=False, cancel_futures=True)


class GrammarChecker:
    """An API process's check that a request's constraint compiles, before the request is
    queued: a bad spec or one past the bounds (bounds.py) gets a 400 naming `field`; one that
    compiles for longer than `timeout_s` too (the engine never sees such a request). A check
    given up (timed out, or its client gone) before its compile started is cancelled; one
    already compiling finishes on its lane (CompileLanes). Compiled grammars stay in the
    compiler's cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.args = tokenizer, vocab_size, stop_token_ids
        self.timeout_s = timeout_s
        self._grammars: Grammars | None = None
        self._made = threading.Lock()
        self._lanes = CompileLanes("tokenmill-grammar-check")

    def _compile(self, params: StructuredOutputsParams) -> None:
        with self._made:  # (both lanes may ask first)
            if self._grammars is None:
                self._grammars = Grammars(*self.args)
        self._grammars.compile(params)

    async def check(self, params: StructuredOutputsParams | None, field: str) -> None:
        if params is None:
            return
        try:
            check_bounds(*params.key())  # (at once, on the loop: it costs microseconds)
        except InvalidParameter as exc:
            raise InvalidParameter(field, f"{field}: {exc}") from None
        future = self._lanes.submit(params, self._compile, params)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                   self.timeout_s)
        except TimeoutError:
            future.cancel()  # (not started yet: it never will be)
            raise InvalidParameter(field, f"{field}: the grammar did not compile within "
                                   f"{self.timeout_s:g} s; simplify it.") from None
        except asyncio.CancelledError:  # the client left
            future.cancel()
            raise
        except InvalidParameter as exc:
            raise InvalidParameter(field, f"{field}: {exc}") from None
