"""The package's import graph: cycles and imports that run from a lower layer up.

Every import of a tokenmill module counts, function-level ones included, read from the source
with `ast` (nothing is imported); those under `if TYPE_CHECKING:` (annotations only) do not.
Run `python -m tests.import_graph` for the report; the suite's test_import_graph.py holds the
house to its limits."""

from __future__ import annotations

import argparse
import ast
import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "tokenmill"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# The layers, lowest first: a module may import its own layer and those below it. A unit is a
# top-level folder or a top-level module (without ".py"). Kept in step with docs/architecture.md.
LAYERS: list[tuple[str, ...]] = [
    ("logs", "host_to_device", "text_buffer", "json_depth", "heap"),
    ("config", "sampling_params", "pooling_params", "mm_inputs", "outputs", "tokenizer"),
    ("core", "csrc", "kv_offload"),
    ("distributed",),
    ("attention", "layers", "quantization"),
    ("platforms", "models"),
    ("hub", "loading", "lora"),
    ("sample", "structured_output"),
    ("worker",),
    ("spec_decode",),
    ("executor",),
    ("engine", "metrics", "beam_search"),
    ("convert", "entrypoints", "static", "__init__"),
]


_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    line: int
    function_level: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module a dotted name lands in: itself, or the nearest package above it."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, name: str, known: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: list[Edge] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in _TYPE_CHECKING:
                continue  # (imports for annotations only: they never run)
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` names a module where one exists, else a name in pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in child.names]
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                resolved = _resolve(target, known)
                if resolved and resolved != name:
                    edges.append(Edge(name, resolved, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return edges


def edges() -> list[Edge]:
    """One edge per importing and imported module pair (its first import)."""
    known = modules()
    first: dict[tuple[str, str], Edge] = {}
    for name, path in known.items():
        for e in _imports(path, name, known):
            first.setdefault((e.source, e.target), e)
    return list(first.values())


def folder(module: str) -> str:
    """The folder a module sits in (a package's __init__ sits in its own folder)."""
    path = modules()[module]
    return str(path.parent.relative_to(ROOT.parent))


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(module: str) -> int:
    u = unit(module)
    for i, names in enumerate(LAYERS):
        if u in names:
            return i
    raise KeyError(f"{module}: its unit {u!r} is in no layer of tests/import_graph.py")


def cycles(all_edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def upward(all_edges: list[Edge]) -> list[Edge]:
    return [e for e in all_edges if layer(e.target) > layer(e.source)]


def cross_folder(cycle: list[str]) -> bool:
    return len({folder(m) for m in cycle}) > 1


def report() -> dict:
    all_edges = edges()
    found = cycles(all_edges)
    up = upward(all_edges)
    return {
        "modules": len(modules()),
        "imports": len(all_edges),
        "function_level": sum(e.function_level for e in all_edges),
        "cycles_across_folders": [c for c in found if cross_folder(c)],
        "cycles_in_one_folder": [c for c in found if not cross_folder(c)],
        "upward": up,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    r = report()
    print(f"{r['modules']} modules, {r['imports']} imports of tokenmill modules "
          f"({r['function_level']} inside functions)")
    for title in ("cycles_across_folders", "cycles_in_one_folder"):
        print(f"{title.replace('_', ' ')}: {len(r[title])}")
        for c in r[title]:
            print("  " + " <-> ".join(c))
    print(f"imports from a lower layer up: {len(r['upward'])}")
    for e in r["upward"]:
        print(f"  {e.source}:{e.line} -> {e.target}")


if __name__ == "__main__":
    main()
