"""What a constraint may cost, checked before it compiles (a refusal names the field).

xgrammar compiles and matches most constraints in milliseconds, but two shapes cost far
more than their size: a JSON schema nested hundreds deep (a 600-deep array schema compiled
for 10 s), and nested counted repetitions in a regular expression, whose next-token mask
takes longer at every token (`((a{0,100}){0,100}){0,100}`: 1 ms at the first token, 33 s
at the 32nd). So a schema's text may nest at most MAX_JSON_DEPTH deep, and along any chain of
nested counted repetitions (`{m,n}` inside `{m,n}`, in a regex or a schema's `pattern`) the
product of their upper bounds may be at most MAX_NESTED_REPEAT. One level alone is cheap
(`.{0,20000}` compiles in 2 s, `a{100000}` at once) and is not limited here. What these
rules miss (an EBNF grammar's own repetitions) is caught while it runs: a request whose mask
takes too long is stopped (manager.py's MASK_CPU_LIMIT_S)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.json_depth import MAX_JSON_DEPTH, nests_deeper
from tokenmill.sampling_params import InvalidParameter

MAX_NESTED_REPEAT = 10_000


def check_bounds(kind: str, spec: str) -> None:
    """Raises InvalidParameter(kind) when the constraint would cost past the bounds."""
    if kind == "regex":
        _check_regex(kind, spec, "regex")
    elif kind == "json":
        if nests_deeper(spec.encode("utf-8", "surrogatepass")):
            raise InvalidParameter(kind, f"json: the schema nests more than {MAX_JSON_DEPTH} "
                                   "levels deep.")
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError):
            return  # (the compiler names what is wrong with it)
        for pattern in _patterns(schema):
            _check_regex(kind, pattern, "json: a pattern in the schema")


def _patterns(schema: Any):
    """Every `pattern` string of a JSON schema (iterative: the depth is bounded already)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_regex(kind: str, regex: str, what: str) -> None:
    product = nested_repeat_product(regex)
    if product > MAX_NESTED_REPEAT:
        raise InvalidParameter(kind, f"{what} nests counted repetitions whose bounds multiply "
                               f"to {product} (at most {MAX_NESTED_REPEAT}): matching it would "
                               "take longer at every token. Flatten the repetitions.")


def nested_repeat_product(regex: str) -> int:
    """The largest product of upper bounds along a chain of two or more nested counted
    repetitions in `regex` (1 when there is none); an unbounded one (`*`, `+`, `{m,}`) counts
    as its lower bound. 1 when Python cannot parse it (the compiler judges it then)."""
    from re import _constants as c  # (Python's own regex parser: the dialects agree on
    from re import _parser as parser  # groups and counted repetitions)

    try:
        tree = parser.parse(regex)
    except Exception:  # noqa: BLE001 - xgrammar's dialect differs here and there
        return 1
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}
    worst = 1

    def chain(items) -> int:
        """The largest product of counted bounds along a chain inside `items` (0: none)."""
        nonlocal worst
        best = 0
        for op, av in items:
            if op in repeats:
                low, high, sub = av
                inner = chain(sub)
                here = (low if high == c.MAXREPEAT else high) or 1
                product = here * max(inner, 1)
                if inner:
                    worst = max(worst, product)
                best = max(best, product)
            elif op == c.SUBPATTERN:
                best = max(best, chain(av[-1]))
            elif op == c.BRANCH:
                best = max([best] + [chain(branch) for branch in av[1]])
        return best

    try:
        chain(tree)
    except RecursionError:  # groups nested past Python's stack: xgrammar bounds nesting itself
        return 1
    return worst
