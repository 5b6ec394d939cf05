"""docs/architecture.md is a true map: every module of the package has its line under its
folder's heading, no line names a module that is not there, each line stays short, and the
layers it lists are those tests/import_graph.py holds the imports to."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def mapped() -> dict[str, str]:
    """Module path (from the repository root) -> its line, read from the doc's sections."""
    found, folder = {}, None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## `(tokenmill/[\w/]*)`", line)
        if heading:
            folder = heading.group(1)
            continue
        if line.startswith("## "):
            folder = None
        entry = re.match(r"- `([\w/]+\.py)` — ", line)
        if folder and entry:
            found[folder + entry.group(1)] = line
    return found


def test_every_module_is_on_the_map_and_nothing_else():
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tokenmill").rglob("*.py")}
    lines = mapped()
    assert sorted(modules - lines.keys()) == []  # missing from the map
    assert sorted(lines.keys() - modules) == []  # on the map, not in the package


def test_each_module_line_is_short():
    long = [line for line in mapped().values() if len(line) > 160]
    assert long == []


def test_the_layers_are_those_the_import_check_holds():
    from tests.import_graph import LAYERS

    listed = [re.findall(r"`([\w/]+)`", line) for line in DOC.read_text().splitlines()
              if re.match(r"\d+\. `", line)]
    assert [{name.rstrip("/") for name in names} for names in listed] == \
        [set(units) - {"__init__"} for units in LAYERS]
