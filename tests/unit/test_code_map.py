"""The README's code map matches the tree: every path it names exists under ``dptrain/``, every module
and package of the package root and every sub-package at any depth is named, and the table's rows
run down the layers in the order the layering test enforces (``test_imports.LAYERS``)."""
from __future__ import annotations

import re
from pathlib import Path

from test_imports import LAYERS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dptrain"
PATH = re.compile(r"`([\w./]+(?:\.py|/))`")
"""A backticked path relative to dptrain/: a module file or a folder."""


def code_map() -> str:
    """The code map's table and what follows it, to the next section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Code map\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "README.md has no '## Code map' section"
    section = m.group(1)
    return section[section.index("\n|") + 1:]  # from the table on: the paragraph above it names files elsewhere


def table_rows(section: str) -> list[list[str]]:
    """The paths column of each table row (the second cell), past the header and its rule."""
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [PATH.findall(row.split("|")[2]) for row in rows]


def component(path: str) -> str:
    """``distributed/`` -> ``dptrain.distributed``; ``cli.py`` -> ``dptrain.cli``; ``__init__.py`` -> ``dptrain``."""
    first = path.split("/")[0]
    name = first.removesuffix(".py")
    return "dptrain" if name == "__init__" else f"dptrain.{name}"


def test_every_path_in_the_code_map_exists():
    named = PATH.findall(code_map())
    assert len(named) > 20, "the scan found almost no paths: the code map's format changed"
    missing = [p for p in named if not (PACKAGE / p).exists()]
    assert not missing, f"README's code map names paths that are not in dptrain/: {missing}"


def test_every_module_and_package_is_in_the_code_map():
    named = set(PATH.findall(code_map()))
    root = {p.name for p in PACKAGE.glob("*.py")} | {f"{p.name}/" for p in PACKAGE.iterdir()
                                                     if (p / "__init__.py").exists()}
    packages = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.rglob("__init__.py")
                if p.parent != PACKAGE}
    absent = sorted((root | packages) - named)
    assert not absent, f"README's code map lacks {absent}: add each to the row of its layer"


def test_the_code_map_runs_down_the_layers():
    depth = {c: i for i, layer in enumerate(LAYERS) for c in layer}
    order = [(p, depth[component(p)]) for row in table_rows(code_map()) for p in row]
    assert order, "no table row with paths in the code map"
    upward = [(a, b) for (a, da), (b, db) in zip(order, order[1:], strict=False) if db < da]
    assert not upward, f"the code map lists a lower layer before a higher one: {upward}"
