"""The dependency rule: each layer of memfit imports only the layers below it.

The layers, lowest first (docs/design.md draws them):

0. ``errors``, ``units``, ``_version``, ``_io``, ``_read``, ``_schema``, ``_html``, ``_plot``, ``distributed``,
   ``batch_search``: plain helpers, torch.distributed agreement, the pure search policy;
1. ``environment``: machine facts, version tables, doctor, environment files;
2. ``cuda``: what CUDA would hold;
3. ``memory``: tracker, allocator model, devices, the GPU table, OOM recognition;
4. ``workload``: Workload, references, the zoo;
5. ``run``: settings, training steps, measure, state;
6. ``guard``: OOM recovery by splitting the batch;
7. ``estimator``: fake-tensor steps, breakdown, sharding, estimate;
8. ``monitor``: recording runs, run files, findings, the timeline;
9. ``reporting``: figures and pages;
10. ``search``: probe, plan, lock, fit;
11. ``cli``: the command line;
12. ``integrations``: Lightning, transformers, torchrun;
13. ``memfit`` itself (``__init__``, ``__main__``): the public API.

Every ``import`` counts, at module level or inside a function: a function-level import
may delay loading torch, never dodge the rule. Within one package, modules must not
import each other in a cycle.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import memfit

PACKAGE = Path(memfit.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "_version", "_io", "_read", "_schema", "_html", "_plot", "distributed", "batch_search"),
    ("environment",),
    ("cuda",),
    ("memory",),
    ("workload",),
    ("run",),
    ("guard",),
    ("estimator",),
    ("monitor",),
    ("reporting",),
    ("search",),
    ("cli",),
    ("integrations",),
    ("__init__", "__main__"),
)
LEVEL = {name: index for index, names in enumerate(LAYERS) for name in names}


def unit_of(module: str) -> str:
    """The layer unit of a dotted module name: its first component under memfit."""
    parts = module.split(".")
    if parts == ["memfit"]:
        return "__init__"
    return parts[1]


def module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split(".")[1:])
    return path.is_dir() or path.with_suffix(".py").exists()


def imported_modules(tree: ast.AST, this: str, is_package: bool, root: Path) -> Iterator[tuple[str, int]]:
    """(memfit module imported, line) for every import statement in ``tree``.

    ``from memfit.pkg import name`` counts as importing ``memfit.pkg.name`` when that is a
    module, else ``memfit.pkg``.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "memfit" or alias.name.startswith("memfit."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = this.split(".") if is_package else this.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "memfit" and not target.startswith("memfit."):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                yield (candidate if _is_module(root, candidate) else target), node.lineno


def violations(root: Path) -> list[str]:
    """Every import that points to a higher layer, and every import cycle inside a package."""
    found = []
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        this = module_name(path, root)
        unit = unit_of(this)
        if unit not in LEVEL:
            found.append(f"{this}: not in any layer (add it to LAYERS and docs/design.md)")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for target, line in imported_modules(tree, this, path.name == "__init__.py", root):
            other = unit_of(target)
            if other not in LEVEL:
                found.append(f"{this}:{line} imports {target}, which is in no layer")
            elif LEVEL[other] > LEVEL[unit]:
                found.append(f"{this}:{line} imports {target} from a higher layer ({other} above {unit})")
            if other == unit and target != this:
                graph.setdefault(this, set()).add(target)
    found.extend(_cycles(graph))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    found: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                found.append("import cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_of(module: str) -> str:
    """The package that owns a module's private names: its unit, or for a private base-layer
    module (``memfit._io``) memfit as a whole: those modules exist to be shared, and their
    names without an underscore are their interface."""
    unit = unit_of(module)
    return "memfit" if _is_private(unit) else unit


def private_reads(root: Path) -> list[str]:
    """Every place a package reads another package's private name: ``from memfit.a.b import
    _name``, or ``b._name`` on a module ``b`` imported from another package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        this = module_name(path, root)
        unit = _package_of(this)
        tree = ast.parse(path.read_text(), str(path))
        modules: dict[str, str] = {}  # local name -> memfit module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("memfit."):
                        modules[alias.asname or "memfit"] = alias.name if alias.asname else "memfit"
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("memfit"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if _is_module(root, target):
                        modules[alias.asname or alias.name] = target
                    elif _is_private(alias.name) and _package_of(node.module or "") != unit:
                        found.append(f"{this}:{node.lineno} imports {alias.name} from {node.module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name):
                target = modules.get(node.value.id)
                if target is not None and _package_of(target) != unit:
                    found.append(f"{this}:{node.lineno} reads {target}.{node.attr}")
    return found


def test_memfit_follows_the_dependency_rule() -> None:
    assert violations(PACKAGE) == []


def test_no_package_reads_another_packages_private_names() -> None:
    assert private_reads(PACKAGE) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "memfit"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "memory/__init__.py": "",
            "memory/devices.py": "from memfit.search.probe import probe\n",
            "search/__init__.py": "",
            "search/probe.py": "def probe(): pass\n",
        },
    )
    assert violations(root) == [
        "memfit.memory.devices:1 imports memfit.search.probe from a higher layer (search above memory)"
    ]


def test_an_upward_import_inside_a_function_is_caught_too(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "run/__init__.py": "",
            "run/measure.py": "def measure():\n    from memfit.reporting import pages\n",
            "reporting/__init__.py": "",
            "reporting/pages.py": "",
        },
    )
    assert violations(root) == [
        "memfit.run.measure:2 imports memfit.reporting.pages from a higher layer (reporting above run)"
    ]


def test_a_cycle_inside_a_package_is_caught(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "workload/__init__.py": "",
            "workload/spec.py": "def f():\n    from memfit.workload import zoo\n",
            "workload/zoo.py": "from memfit.workload.spec import f\n",
        },
    )
    found = violations(root)
    assert any(v.startswith("import cycle:") and "memfit.workload.spec" in v for v in found), found


def test_a_planted_private_read_is_caught_both_ways(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "_io.py": "def write_atomically(): pass\n",
            "memory/__init__.py": "",
            "memory/tracker.py": "_state = None\ndef _storages(): pass\n",
            "memory/devices.py": "from memfit.memory.tracker import _storages\n",
            "run/__init__.py": "",
            "run/steps.py": (
                "from memfit.memory import tracker\n"
                "from memfit._io import write_atomically\n"
                "def f():\n    tracker._state = 1\n"
            ),
            "estimator/__init__.py": "",
            "estimator/fake.py": "from memfit.memory.tracker import _storages\n",
        },
    )
    assert private_reads(root) == [
        "memfit.estimator.fake:1 imports _storages from memfit.memory.tracker",
        "memfit.run.steps:4 reads memfit.memory.tracker._state",
    ]


@pytest.mark.parametrize("name", ["errors", "cuda", "memory", "search", "integrations"])
def test_every_layer_named_exists(name: str) -> None:
    assert (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()
