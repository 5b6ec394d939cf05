"""The house's shape, held by the suite: no import cycle at all (across folders or inside one), few
imports from a lower layer up (tests/import_graph.py), every module saying its job in its first
line and none past 400 lines."""

import ast

import pytest

from tests import import_graph as graph


@pytest.fixture(scope="module")
def report():
    return graph.report()


def test_no_import_cycle_spans_two_folders(report):
    assert report["cycles_across_folders"] == []


def test_no_import_cycle_inside_one_folder(report):
    # (the issue allowed two; both are gone, so a new one is a regression)
    assert report["cycles_in_one_folder"] == []


def test_at_most_twelve_imports_run_up_the_layers(report):
    up = [f"{e.source}:{e.line} -> {e.target}" for e in report["upward"]]
    assert len(up) <= 12, up


def test_the_check_finds_a_cycle_and_an_upward_import():
    """The checks above can fail: a cycle through three modules is one component, and an
    import from the engine core into the entrypoints runs up."""
    edges = [graph.Edge("a", "b", 1, False), graph.Edge("b", "c", 1, False),
             graph.Edge("c", "a", 3, True), graph.Edge("c", "d", 4, False)]
    assert graph.cycles(edges) == [["a", "b", "c"]]
    up = graph.Edge("tokenmill.engine.engine_core", "tokenmill.entrypoints.serve", 1, True)
    down = graph.Edge("tokenmill.entrypoints.serve", "tokenmill.engine.engine_core", 1, False)
    assert graph.upward([up, down]) == [up]
    assert graph.cross_folder(["tokenmill.engine.engine_core", "tokenmill.worker.model_runner"])
    assert not graph.cross_folder(["tokenmill.layers.linear", "tokenmill.layers.skinny"])


def test_every_module_has_a_layer():
    for module in graph.modules():
        graph.layer(module)  # (KeyError naming the module otherwise)


def test_every_module_starts_by_saying_its_job():
    missing = [str(path) for path in graph.modules().values()
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert missing == []


def test_no_module_is_past_400_lines():
    long = {str(p): n for p in graph.modules().values()
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
