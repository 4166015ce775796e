"""memfit: end "CUDA out of memory" in PyTorch training.

The public API, re-exported from the modules that hold it (imported on first use, so
``import memfit`` and ``memfit doctor`` stay fast):

>>> import memfit
>>> memfit.measure("mlp:layers=2,width=64", batch_size=16, device="sim:1GiB").fits
True
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version as _version
from typing import TYPE_CHECKING, Any

try:
    __version__ = _version("memfit")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # foundation
    "MemfitError": "memfit.errors",
    "WorkloadError": "memfit.errors",
    "DeviceError": "memfit.errors",
    "DoesNotFitError": "memfit.errors",
    "parse_size": "memfit.units",
    "format_size": "memfit.units",
    "is_oom": "memfit.oom",
    "Workload": "memfit.workload",
    "load_workload": "memfit.workload",
    "Settings": "memfit.settings",
    "Device": "memfit.memory.devices",
    "SimDevice": "memfit.memory.devices",
    "CudaDevice": "memfit.memory.devices",
    "device": "memfit.memory.devices",
    "run_steps": "memfit.training",
    "measure": "memfit.measurement",
    "Measurement": "memfit.measurement",
    # doctor and env
    "diagnose": "memfit.doctor",
    "Diagnosis": "memfit.doctor",
    "TrainingHints": "memfit.doctor",
    "fingerprint": "memfit.envfile",
    "Fingerprint": "memfit.envfile",
    "Difference": "memfit.envfile",
    "compare": "memfit.envfile",
    "check_environment": "memfit.envfile",
    "export_environment": "memfit.envfile",
    "load_fingerprint": "memfit.envfile",
    # estimate, probe, guard
    "estimate": "memfit.estimation",
    "Estimate": "memfit.estimation",
    "probe": "memfit.probing",
    "ProbeResult": "memfit.probing",
    "Guard": "memfit.guard",
    # monitor and reports
    "Monitor": "memfit.monitor",
    "RecordedRun": "memfit.monitor",
    "read_run": "memfit.monitor",
    "analyze_steps": "memfit.findings",
    "write_report": "memfit.report",
    "ReportFiles": "memfit.report",
    "to_html": "memfit.report",
    # plan, fit and lock
    "fit": "memfit.fitting",
    "FitResult": "memfit.fitting",
    "plan": "memfit.planning",
    "Plan": "memfit.planning",
    "Lock": "memfit.lockfile",
    "load_lock": "memfit.lockfile",
    "write_lock": "memfit.lockfile",
    "check_lock": "memfit.lockfile",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from memfit.doctor import Diagnosis, TrainingHints, diagnose
    from memfit.envfile import (
        Difference,
        Fingerprint,
        check_environment,
        compare,
        export_environment,
        fingerprint,
        load_fingerprint,
    )
    from memfit.estimation import Estimate, estimate
    from memfit.findings import analyze_steps
    from memfit.fitting import FitResult, fit
    from memfit.guard import Guard
    from memfit.monitor import Monitor, RecordedRun, read_run
    from memfit.probing import ProbeResult, probe
    from memfit.report import ReportFiles, to_html, write_report
    from memfit.errors import DeviceError, DoesNotFitError, MemfitError, WorkloadError
    from memfit.lockfile import Lock, check_lock, load_lock, write_lock
    from memfit.measurement import Measurement, measure
    from memfit.memory.devices import CudaDevice, Device, SimDevice, device
    from memfit.oom import is_oom
    from memfit.planning import Plan, plan
    from memfit.settings import Settings
    from memfit.training import run_steps
    from memfit.units import format_size, parse_size
    from memfit.workload import Workload, load_workload
