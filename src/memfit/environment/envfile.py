"""Environment files that reproduce a training setup, and the fingerprint that checks one.

``export_environment(DIR)`` writes ``environment.yml`` (conda's own export with the pip
packages merged in, or the Python version plus a ``pip:`` section), ``requirements.lock.txt``
(exact versions that keep torch's CUDA variant, with the matching ``--extra-index-url``) and
``environment.json``: a :class:`Fingerprint` (Python, OS, torch, its CUDA and cuDNN, the
driver, each GPU's name, memory and capability). :func:`compare` lists what differs between
two fingerprints and which differences matter (torch, CUDA, GPU model, an older driver);
the lock file reuses :func:`fingerprint` and :func:`compare`.

>>> old = Fingerprint(python="3.11.7", os="Linux x86_64", torch="2.5.1+cu124", torch_cuda="12.4")
>>> new = Fingerprint(python="3.11.7", os="Linux x86_64", torch="2.6.0+cu124", torch_cuda="12.4")
>>> [(d.field, d.old, d.new, d.matters) for d in compare(old, new)]
[('torch', '2.5.1+cu124', '2.6.0+cu124', True)]
>>> torch_index_url("2.5.1+cu124")
'https://download.pytorch.org/whl/cu124'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from memfit._html import HtmlRepr
from memfit._io import check_writable, check_writable_folder, write_atomically
from memfit._read import load_json
from memfit._schema import MAX_BYTES, Field, Rows, Table, shown
from memfit.environment import system
from memfit.environment.system import SystemProbe
from memfit.environment.versions import format_cudnn_version, version_tuple
from memfit.errors import MemfitError

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "Distribution",
    "GpuFingerprint",
    "Fingerprint",
    "Difference",
    "fingerprint",
    "compare",
    "load_fingerprint",
    "export_environment",
    "check_environment",
    "EnvironmentCheck",
    "installed_distributions",
    "requirement_lines",
    "environment_document",
    "to_yaml",
    "torch_index_url",
]

SCHEMA = "memfit.environment"
SCHEMA_VERSION = 1
FILES = ("environment.yml", "requirements.lock.txt", "environment.json")

#: local version tags of wheels that live on download.pytorch.org, not PyPI
_TORCH_TAG = re.compile(r"^(cu\d+|cpu|rocm[\d.]+|xpu)$")


@dataclass(frozen=True)
class Distribution:
    """An installed Python distribution: how pip sees it, and how it got there."""

    name: str
    version: str
    installer: str = "pip"
    direct_url: dict[str, Any] | None = None


@dataclass(frozen=True)
class GpuFingerprint:
    name: str
    memory: int
    capability: str


@dataclass(frozen=True)
class Fingerprint:
    """What decides whether a measured memory budget holds on another machine."""

    python: str
    os: str
    os_release: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None
    cudnn: str | None = None
    driver: str | None = None
    cuda_driver: str | None = None
    gpus: tuple[GpuFingerprint, ...] = ()

    def to_dict(self, omit_missing: bool = False) -> dict[str, Any]:
        """JSON-ready; ``omit_missing`` drops None values (TOML has no null)."""
        body = asdict(self)
        body["gpus"] = [asdict(gpu) for gpu in self.gpus]
        if omit_missing:
            body = {key: value for key, value in body.items() if value is not None}
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **body}

    @classmethod
    def from_dict(cls, data: Any, source: str = "fingerprint", prefix: str = "", damaged: str = "") -> Fingerprint:
        """Read a fingerprint written by :meth:`to_dict`; anything else is a one-line MemfitError.

        Args:
            data: the parsed JSON (or a lock's TOML table).
            source: how a message names where it came from.
            prefix: the fields' path inside a larger file (a lock's ``environment.``).
            damaged: how a message about a bad field starts (default: the source is damaged).

        Every field is checked (:data:`FINGERPRINT_SCHEMA`): ``python: null``, a number
        where a version goes, a GPU of ``true`` bytes are refused, naming the field.
        """
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise MemfitError(f'{source} is not a memfit environment fingerprint (no "schema": "{SCHEMA}")')
        version = data.get("schema_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            raise MemfitError(
                f"{source} has schema_version {shown(version)}; this memfit reads up to {SCHEMA_VERSION}: upgrade memfit"
            )
        FINGERPRINT_SCHEMA.check(data, damaged or f"{source} is a damaged memfit fingerprint", prefix)
        return cls(
            python=data["python"],
            os=data["os"],
            os_release=data.get("os_release"),
            torch=data.get("torch"),
            torch_cuda=data.get("torch_cuda"),
            cudnn=data.get("cudnn"),
            driver=data.get("driver"),
            cuda_driver=data.get("cuda_driver"),
            gpus=tuple(GpuFingerprint(g["name"], g["memory"], g["capability"]) for g in data.get("gpus", [])),
        )


def _version_field(required: bool = False) -> Field:
    return Field("str", required=required, nullable=not required, low=1 if required else None, high=200)


#: what environment.json (and a lock's [environment] table) holds, field by field; keys a
#: newer memfit of the same schema version may add are left alone
FINGERPRINT_SCHEMA = Table(
    {
        "schema": Field("str"),
        "schema_version": Field("int", low=1, high=SCHEMA_VERSION),
        "python": _version_field(required=True),
        "os": _version_field(required=True),
        **{name: _version_field() for name in ("os_release", "torch", "torch_cuda", "cudnn", "driver", "cuda_driver")},
        "gpus": Rows(
            Table(
                {
                    "name": Field("str", low=1, high=200),
                    "memory": Field("int", low=0, high=MAX_BYTES),
                    "capability": Field("str", low=1, high=20),
                }
            ),
            required=False,
        ),
    }
)


@dataclass(frozen=True)
class Difference:
    """One field that differs; ``matters`` when it can change what fits (or whether CUDA runs)."""

    field: str
    old: Any
    new: Any
    matters: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EnvironmentCheck(HtmlRepr):
    """A recorded environment (a lock's, an environment.json) against this machine.

    The one result of ``memfit check`` and ``memfit env check``: every difference, whether
    one matters (it can change what fits, or whether CUDA runs at all), and what to do.
    """

    #: what the recorded fingerprint came from ("memfit.lock", "env/environment.json")
    source: str
    differences: list[Difference]

    @property
    def matters(self) -> bool:
        return any(d.matters for d in self.differences)

    @property
    def gpu_changed(self) -> bool:
        return any(d.field.startswith("gpus") for d in self.differences)

    @property
    def exit_status(self) -> int:
        """1 when a difference matters, else 0 (the commands' exit status)."""
        return 1 if self.matters else 0

    def advice(self) -> list[str]:
        """What to do about the differences, one sentence each."""
        if self.gpu_changed:
            return ["The GPU changed: run `memfit probe` (or `memfit fit`) again before training."]
        if self.matters:
            return ["torch, CUDA or the driver changed: memory use can differ; re-run `memfit fit` to re-measure."]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "exit_status": self.exit_status,
            "matters": self.matters,
            "differences": [d.to_dict() for d in self.differences],
            "advice": self.advice(),
        }


# -- fingerprint and comparison ----------------------------------------------------------


def fingerprint(probe: SystemProbe | None = None) -> Fingerprint:
    """This machine's fingerprint (torch's build read without a CUDA context here)."""
    probe = probe or system.current_probe()
    python, host, torch, nvidia = probe.python(), probe.host(), probe.torch_build(), probe.nvidia()
    cuda_driver = nvidia.cuda_driver_version
    return Fingerprint(
        python=python.version,
        os=f"{host.system} {host.machine}",
        os_release=host.release,
        torch=torch.version,
        torch_cuda=torch.cuda,
        cudnn=format_cudnn_version(torch.cudnn) if torch.cudnn else None,
        driver=nvidia.driver_version,
        cuda_driver=f"{cuda_driver[0]}.{cuda_driver[1]}" if cuda_driver else None,
        gpus=tuple(
            GpuFingerprint(gpu.name, gpu.total_memory, f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}")
            for gpu in nvidia.gpus
        ),
    )


def _is_older(old: str | None, new: str | None) -> bool:
    """True when version ``new`` is older than ``old`` (a driver downgrade)."""
    return bool(old and new and version_tuple(new) < version_tuple(old))


def compare(old: Fingerprint, new: Fingerprint) -> list[Difference]:
    """Every difference from ``old`` (recorded) to ``new`` (here), in a fixed field order."""
    differences = []
    for name in ("python", "os", "os_release", "torch", "torch_cuda", "cudnn", "driver", "cuda_driver"):
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name in ("torch", "torch_cuda"):
            matters, note = True, "another build runs other kernels and allocates differently"
        elif name in ("driver", "cuda_driver"):
            matters = _is_older(before, after) or after is None
            note = "older: it may not run the recorded CUDA" if matters else "newer: runs what the old one ran"
        else:
            matters, note = False, ""
        differences.append(Difference(name, before, after, matters, note))
    if len(old.gpus) != len(new.gpus):
        differences.append(Difference("gpus", len(old.gpus), len(new.gpus), True, "number of GPUs"))
    for index, (before, after) in enumerate(zip(old.gpus, new.gpus)):
        for name in ("name", "capability", "memory"):
            a, b = getattr(before, name), getattr(after, name)
            if a != b:
                matters = name != "memory"
                differences.append(
                    Difference(f"gpus[{index}].{name}", a, b, matters, "another GPU model" if matters else "")
                )
    return differences


def load_fingerprint(path: str | os.PathLike[str]) -> Fingerprint:
    """Read environment.json; unreadable, corrupt or foreign files raise a one-line MemfitError."""
    data = load_json(path, "environment file", hint="expected a file written by memfit env export")
    return Fingerprint.from_dict(data, source=str(path))


def check_environment(path: str | os.PathLike[str], probe: SystemProbe | None = None) -> EnvironmentCheck:
    """Compare the environment recorded in ``path`` (``memfit env export``'s environment.json) with this machine.

    Args:
        path: an ``environment.json`` written by :func:`export_environment`.
        probe: where this machine's facts come from (default: the live machine).
    """
    recorded = load_fingerprint(path)
    return EnvironmentCheck(str(path), compare(recorded, fingerprint(probe)))


# -- pip and conda package lists ---------------------------------------------------------


def canonical_name(name: str) -> str:
    """PEP 503 name: "Foo_Bar" and "foo-bar" are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> list[Distribution]:
    """The distributions this interpreter imports, each once (the first on sys.path wins)."""
    seen: dict[str, Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical_name(name) in seen:
            continue
        direct = dist.read_text("direct_url.json")
        try:
            direct_url = json.loads(direct) if direct else None
        except json.JSONDecodeError:
            direct_url = None
        installer = (dist.read_text("INSTALLER") or "pip").strip() or "pip"
        seen[canonical_name(name)] = Distribution(name, dist.version, installer, direct_url)
    return sorted(seen.values(), key=lambda d: canonical_name(d.name))


def torch_index_url(version: str) -> str | None:
    """The download.pytorch.org index a local version tag comes from: "2.5.1+cu124" -> .../cu124."""
    _, plus, tag = version.partition("+")
    return f"https://download.pytorch.org/whl/{tag}" if plus and _TORCH_TAG.match(tag) else None


def requirement_line(dist: Distribution) -> str:
    """One exact requirement; what pip cannot reinstall by version alone stays as a comment."""
    url = dist.direct_url or {}
    if "vcs_info" in url:
        vcs = url["vcs_info"]
        return f"{dist.name} @ {vcs.get('vcs', 'git')}+{url['url']}@{vcs.get('commit_id', '')}"
    if url.get("dir_info", {}).get("editable"):
        return (
            f"# {dist.name}=={dist.version} is installed editable from {url.get('url')}: pip install -e <that checkout>"
        )
    if url.get("url", "").startswith("file:"):
        return f"# {dist.name}=={dist.version} is installed from a local file {url['url']}"
    if url.get("url"):
        return f"{dist.name} @ {url['url']}"
    return f"{dist.name}=={dist.version}"


def requirement_lines(dists: Iterable[Distribution]) -> list[str]:
    """Exact requirements, torch's CUDA variant kept together with the index that serves it."""
    dists = list(dists)
    indexes = sorted({url for url in (torch_index_url(d.version) for d in dists) if url})
    return [f"--extra-index-url {url}" for url in indexes] + [requirement_line(d) for d in dists]


def merge_conda_pip(conda_export: dict[str, Any], dists: Iterable[Distribution]) -> dict[str, Any]:
    """conda's export with its pip section replaced by exact pip requirements.

    Why merge: conda lists pip packages without torch's CUDA tag or index; distributions
    conda itself installed stay in its own section.
    """
    dists = [d for d in dists if d.installer != "conda"]
    ours = {canonical_name(d.name) for d in dists}
    conda_deps: list[Any] = []
    conda_pip: list[str] = []
    for dep in conda_export.get("dependencies", []):
        if isinstance(dep, dict) and "pip" in dep:
            conda_pip.extend(str(line) for line in dep["pip"])
        else:
            conda_deps.append(str(dep))
    pip_lines = [line for line in requirement_lines(dists) if not line.startswith("#")]
    pip_lines += [
        line
        for line in conda_pip
        if canonical_name(re.split(r"[=<>!~@ ;\[]", line, maxsplit=1)[0]) not in ours and not line.startswith("-")
    ]
    if pip_lines and not any(re.match(r"^pip([=<> ]|$)", dep) for dep in conda_deps):
        conda_deps.append("pip")
    document: dict[str, Any] = {"name": conda_export.get("name") or "memfit-env"}
    if conda_export.get("channels"):
        document["channels"] = [str(channel) for channel in conda_export["channels"]]
    document["dependencies"] = conda_deps + ([{"pip": pip_lines}] if pip_lines else [])
    return document


def environment_document(
    name: str, python_version: str, dists: Iterable[Distribution], conda_export: dict[str, Any] | None = None
) -> dict[str, Any]:
    """environment.yml's content: conda's export merged with pip, or Python plus a pip section."""
    if conda_export is not None:
        return merge_conda_pip(conda_export, dists)
    kept = (d for d in dists if canonical_name(d.name) not in ("pip", "setuptools", "wheel"))
    pip_lines = [line for line in requirement_lines(kept) if not line.startswith("#")]
    return {"name": name, "dependencies": [f"python={python_version}", "pip", {"pip": pip_lines}]}


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.=<>!~+*/@-]*$")
_AMBIGUOUS = re.compile(r"^(true|false|yes|no|on|off|null|y|n|~)$", re.I)


def _yaml_scalar(text: str) -> str:
    """A YAML scalar: plain when unambiguous, else double-quoted (JSON escapes are valid YAML)."""
    return text if _PLAIN.match(text) and not _AMBIGUOUS.match(text) else json.dumps(text)


def to_yaml(document: dict[str, Any]) -> str:
    """environment.yml text for its one shape: scalars, lists of strings, one nested pip list.

    >>> print(to_yaml({"name": "x", "dependencies": ["python=3.11", {"pip": ["a==1"]}]}), end="")
    name: x
    dependencies:
      - python=3.11
      - pip:
          - a==1
    """
    lines = []
    for key, value in document.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            for item in value:
                if isinstance(item, dict):
                    for sub_key, sub_items in item.items():
                        lines.append(f"  - {sub_key}:")
                        lines.extend(f"      - {_yaml_scalar(str(sub))}" for sub in sub_items)
                else:
                    lines.append(f"  - {_yaml_scalar(str(item))}")
        else:
            lines.append(f"{key}: {_yaml_scalar(str(value))}")
    return "\n".join(lines) + "\n"


# -- writing the files -------------------------------------------------------------------


def _env_name(prefix: str) -> str:
    """A conda-friendly env name for a prefix: ".venv" in /work/app becomes "app"."""
    path = Path(prefix)
    name = path.name if not path.name.startswith(".") else path.parent.name
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name) or "memfit-env"


@dataclass(frozen=True)
class Export:
    """What :func:`export_environment` wrote."""

    paths: tuple[Path, ...]
    fingerprint: Fingerprint
    conda: bool
    packages: int = field(default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "paths": [str(p) for p in self.paths],
            "conda": self.conda,
            "packages": self.packages,
            "fingerprint": self.fingerprint.to_dict(),
        }


def export_environment(
    directory: str | os.PathLike[str] = ".", probe: SystemProbe | None = None, dists: list[Distribution] | None = None
) -> Export:
    """Write environment.yml, requirements.lock.txt and environment.json into ``directory``.

    All three are built before any is written, and each is written atomically.

    Args:
        directory: the folder to write into (created when missing).
        probe: where the machine's facts come from (default: the live machine).
        dists: the installed distributions to list (default: this environment's).
    """
    target = check_writable_folder(directory, "env export -o")  # before pip and conda are asked
    for filename in FILES:
        check_writable(target / filename, "env export -o")
    probe = probe or system.current_probe()
    dists = installed_distributions() if dists is None else dists
    python = probe.python()
    conda_export = probe.conda_export()
    name = python.conda_env or _env_name(python.prefix)
    print_ = fingerprint(probe)
    header = (
        f"# written by memfit env export: Python {python.version}, torch {print_.torch}"
        f"{f' (CUDA {print_.torch_cuda})' if print_.torch_cuda else ''}\n"
    )
    texts = {
        "environment.yml": header + to_yaml(environment_document(name, python.version, dists, conda_export)),
        "requirements.lock.txt": header + "\n".join(requirement_lines(dists)) + "\n",
        "environment.json": json.dumps(print_.to_dict(), indent=2) + "\n",
    }
    target.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename in FILES:
        write_atomically(target / filename, texts[filename])
        paths.append(target / filename)
    return Export(tuple(paths), print_, conda_export is not None, len(dists))
