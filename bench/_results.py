"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone.

Each bench script owns the text between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``;
a section that is not there yet is appended. The file is replaced atomically.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

_HEADER = "# memfit benchmarks\n\nEach section is written by the script and command it names.\n"


def write_section(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section ``name`` of docs/benchmarks.md with ``text``."""
    current = path.read_text() if path.exists() else _HEADER
    block = f"<!-- begin {name} -->\n{text.rstrip()}\n<!-- end {name} -->"
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    if pattern.search(current):
        updated = pattern.sub(lambda _m: block, current)
    else:
        updated = current.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".benchmarks-")
    with os.fdopen(fd, "w") as handle:
        handle.write(updated)
    os.replace(tmp, path)
