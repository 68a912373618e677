"""dptrain's import graph: no cycle, no upward or sideways import, and every module imports on its own.

The graph is read from the source (``ast``), so it holds every import wherever it sits: at
the top, inside a function (a lazy import still runs, only later) and under ``if
TYPE_CHECKING:`` (a type-only import that closes a loop is still a loop a reader has to
untangle, and it breaks the day someone needs the name at run time). ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. The implicit
import of a parent package (``dptrain.data`` before ``dptrain.data.transforms.render``) is not an
edge; the fresh-interpreter test below catches what it could break.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dptrain"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dptrain", "dptrain.__main__", "dptrain.torchrun"),
    ("dptrain.cli",),
    ("dptrain.launcher",),
    ("dptrain.tools",),
    ("dptrain.run",),
    ("dptrain.train",),
    ("dptrain.weights", "dptrain.assemble"),
    ("dptrain.optimizer", "dptrain.snapshots", "dptrain.data", "dptrain.memory_format"),
    ("dptrain.distributed", "dptrain.precision", "dptrain.overflow", "dptrain.param_groups"),
    ("dptrain.kernels", "dptrain.flat"),
    ("dptrain.config",),
    ("dptrain.inductor",),
    ("dptrain.topology", "dptrain.observe", "dptrain.models", "dptrain.hostmem", "dptrain.csrc"),
    ("dptrain.errors",),
)
"""Components from the top layer down (STYLE.md section 1: ``train -> {distributed, solver, data,
models} -> {precision, kernels} -> config``; only ``run`` and the tools above it import ``train``,
and only the entry points above them import ``cli`` and ``tools``). A component is a top-level
module or subpackage of dptrain (the wings: ``distributed`` communication, ``data`` input, ``kernels``
update rules, ``observe`` records, ``tools`` the side commands, ``csrc`` native sources). It may
import components of lower layers only: not its own layer's others (so ``data`` never reaches
``distributed`` or ``optimizer``) and not a higher one. Modules
inside one component (``dptrain.data.*``) may import each other; the cycle test covers them.
``models`` sits below ``config`` because the config checks ``model.name`` against the zoo when
it loads, and the zoo imports nothing but ``errors`` (STYLE: models have no distributed,
precision or config imports). The package root ``dptrain`` sits on top with the entry points: it
forwards its public entry ``dptrain.fit`` (``dptrain.run``) on first use, and no module imports it."""

DATA_LAYERS: tuple[tuple[str, ...], ...] = (
    ("dptrain.data",),
    ("dptrain.data.sources",),
    ("dptrain.data.loader",),
    ("dptrain.data.transforms",),
    ("dptrain.data.caffe",),
    ("dptrain.data.base",),
    ("dptrain.data.sampling",),
)
"""The input wing's rooms, from the top down: the seam's ``build_source`` (``dptrain.data``) picks a
source; ``sources`` wire the ``loader``'s threads to the ``transforms`` that render a record, which
read the ``caffe`` formats; ``base`` (the DataSource, HostBatch and DeviceFeeder the trainer sees) and
``sampling`` (the order) sit at the bottom, so every room may use them."""

RUN_ONLY = {"dptrain.__main__"}
"""Modules that run the CLI when imported: they are not imported by the fresh-interpreter test."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the dptrain package, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The dptrain module ``name`` loads: itself, or the longest prefix that is a module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, importer: str, known: dict[str, Path]) -> list[str]:
    """The dptrain modules one import statement of ``importer`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            is_package = known[importer].name == "__init__.py"
            anchor = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = (_resolve(n, known) for n in names if n == "dptrain" or n.startswith("dptrain."))
    return sorted({t for t in found if t is not None})


def import_graph() -> dict[str, set[str]]:
    """dptrain module -> the dptrain modules it imports, anywhere in its source."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(node, name, known)}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per cycle the depth-first walk meets."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def component(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of() -> dict[str, int]:
    return {c: depth for depth, layer in enumerate(LAYERS) for c in layer}


def test_graph_reader_resolves_submodules_packages_and_relative_imports():
    known = modules()
    src = ("from dptrain.data.transforms import jpeg_crop\nfrom dptrain.data import build_source\n"
           "import dptrain.models\nfrom . import render\nfrom ...errors import DataError\nimport numpy\n")
    tree = ast.parse(src)
    found = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _targets(node, "dptrain.data.transforms.native", known)}
    assert found == {"dptrain.data.transforms.jpeg_crop", "dptrain.data", "dptrain.models",
                     "dptrain.data.transforms.render", "dptrain.errors"}


def test_cycle_finder_reports_the_closed_path():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in dptrain: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_component_has_a_layer():
    placed = layer_of()
    missing = sorted({component(m) for m in modules()} - placed.keys())
    assert not missing, f"components {missing} are in no layer; add each to LAYERS in {Path(__file__).name}"
    assert len(placed) == sum(len(layer) for layer in LAYERS), "a component is listed in two layers"


ROOT_MODULES_MAX = 20
"""Modules on the package root besides __init__ and __main__: past this, a new module belongs in a wing."""


def test_the_package_root_stays_small():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules on dptrain/'s root: {root}"


def test_no_upward_or_sideways_import():
    depth = layer_of()
    wrong = []
    for importer, imported in sorted(import_graph().items()):
        for target in sorted(imported):
            a, b = component(importer), component(target)
            if a != b and depth.get(b, -1) <= depth.get(a, -1):
                kind = "sideways" if depth.get(b) == depth.get(a) else "upward"
                wrong.append(f"{importer} -> {target} ({kind})")
    assert not wrong, "imports against the layers of LAYERS: " + "; ".join(wrong)


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """Each module is imported with no dptrain module loaded before it, as ``python -c "import X"``
    would. One interpreter, for time: the third-party libraries are imported once, and every
    dptrain module is dropped from ``sys.modules`` before the next one is imported."""
    names = sorted(set(modules()) - RUN_ONLY)
    assert "dptrain.data.loader.stream" in names and "dptrain.data.loader.renderers" in names, names
    script = (
        "import importlib, sys, traceback\n"
        "import lmdb, numpy, PIL.Image, torch\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'dptrain' or m.startswith('dptrain.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        f"        assert module.__file__.startswith({str(PACKAGE)!r}), module.__file__\n"
        "    except BaseException:\n"
        "        failed.append(name + ':\\n' + traceback.format_exc())\n"
        "print('\\n'.join(failed))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"modules that fail to import on their own:\n{proc.stdout}"


def data_room(module: str) -> str:
    """The room of the input wing ``module`` sits in (``dptrain.data.loader.stream`` -> ``dptrain.data.loader``)."""
    return ".".join(module.split(".")[:3])


def test_every_data_room_has_a_layer():
    placed = {r for layer in DATA_LAYERS for r in layer}
    rooms = {data_room(m) for m in modules() if m == "dptrain.data" or m.startswith("dptrain.data.")}
    assert rooms == placed, f"rooms of dptrain/data in no layer: {sorted(rooms - placed)}; gone: {sorted(placed - rooms)}"


def test_the_data_wing_imports_only_downwards():
    depth = {r: d for d, layer in enumerate(DATA_LAYERS) for r in layer}
    wrong = [f"{a} -> {b}" for a, targets in sorted(import_graph().items()) if a.startswith("dptrain.data")
             for b in sorted(targets) if b.startswith("dptrain.data") and data_room(a) != data_room(b)
             and depth[data_room(b)] <= depth[data_room(a)]]
    assert not wrong, "imports against the input wing's rooms (DATA_LAYERS): " + "; ".join(wrong)

