"""The shape a newcomer can read: short modules, short functions, few positional parameters.

The limits (issue 24): no module over 800 lines, no function over 100 lines (a command's
click option declarations are decorators, outside the count), no private helper with more
than 6 positional parameters (group them in a request object, or make them keyword-only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import memfit

PACKAGE = Path(memfit.__file__).parent
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
MAX_POSITIONAL = 6


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _positional(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    names = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def shape_violations(root: Path) -> list[str]:
    """Every module, function and private helper over its limit, as ``path:line what``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root.parent)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
        for function in _functions(ast.parse(text, str(path))):
            assert function.end_lineno is not None
            length = function.end_lineno - function.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{function.lineno} {function.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
            private = function.name.startswith("_") and not function.name.startswith("__")
            if private and (count := _positional(function)) > MAX_POSITIONAL:
                found.append(f"{name}:{function.lineno} {function.name}: {count} positional parameters")
    return found


def test_memfit_keeps_its_modules_functions_and_helpers_short() -> None:
    assert shape_violations(PACKAGE) == []


def test_a_planted_long_function_and_a_wide_helper_are_caught(tmp_path: Path) -> None:
    root = tmp_path / "memfit"
    root.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (root / "long.py").write_text(f"def long():\n{body}\n\n\ndef _wide(self, a, b, c, d, e, f, g):\n    pass\n")
    (root / "fine.py").write_text("def _ok(self, a, b, c, d, e, f, *, g):\n    pass\n")
    assert shape_violations(root) == [
        "memfit/long.py:1 long: 101 lines (at most 100)",
        "memfit/long.py:104 _wide: 7 positional parameters",
    ]
