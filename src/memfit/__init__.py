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
    "is_oom": "memfit.memory.oom",
    "Workload": "memfit.workload.spec",
    "load_workload": "memfit.workload.spec",
    "Settings": "memfit.run.settings",
    "Device": "memfit.memory.devices",
    "SimDevice": "memfit.memory.devices",
    "CudaDevice": "memfit.memory.devices",
    "device": "memfit.memory.devices",
    "run_steps": "memfit.run.steps",
    "measure": "memfit.run.measure",
    "Measurement": "memfit.run.measure",
    # doctor and env
    "diagnose": "memfit.environment.doctor",
    "Diagnosis": "memfit.environment.doctor",
    "TrainingHints": "memfit.environment.doctor",
    "fingerprint": "memfit.environment.envfile",
    "Fingerprint": "memfit.environment.envfile",
    "Difference": "memfit.environment.envfile",
    "compare": "memfit.environment.envfile",
    "check_environment": "memfit.environment.envfile",
    "export_environment": "memfit.environment.envfile",
    "load_fingerprint": "memfit.environment.envfile",
    # estimate, probe, guard
    "estimate": "memfit.estimator.estimate",
    "Estimate": "memfit.estimator.estimate",
    "probe": "memfit.search.probe",
    "ProbeResult": "memfit.search.probe",
    "Guard": "memfit.guard.splitter",
    # monitor and reports
    "Monitor": "memfit.monitor.monitor",
    "RecordedRun": "memfit.monitor.monitor",
    "read_run": "memfit.monitor.monitor",
    "analyze_steps": "memfit.monitor.findings",
    "write_report": "memfit.reporting.pages",
    "ReportFiles": "memfit.reporting.pages",
    "to_html": "memfit.reporting.pages",
    # plan, fit and lock
    "fit": "memfit.search.fit",
    "FitResult": "memfit.search.fit",
    "plan": "memfit.search.plan",
    "Plan": "memfit.search.plan",
    "Lock": "memfit.search.lock",
    "load_lock": "memfit.search.lock",
    "write_lock": "memfit.search.lock",
    "check_lock": "memfit.search.lock",
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
    from memfit.environment.doctor import Diagnosis, TrainingHints, diagnose
    from memfit.environment.envfile import (
        Difference,
        Fingerprint,
        check_environment,
        compare,
        export_environment,
        fingerprint,
        load_fingerprint,
    )
    from memfit.estimator.estimate import Estimate, estimate
    from memfit.monitor.findings import analyze_steps
    from memfit.search.fit import FitResult, fit
    from memfit.guard.splitter import Guard
    from memfit.monitor.monitor import Monitor, RecordedRun, read_run
    from memfit.search.probe import ProbeResult, probe
    from memfit.reporting.pages import ReportFiles, to_html, write_report
    from memfit.errors import DeviceError, DoesNotFitError, MemfitError, WorkloadError
    from memfit.search.lock import Lock, check_lock, load_lock, write_lock
    from memfit.run.measure import Measurement, measure
    from memfit.memory.devices import CudaDevice, Device, SimDevice, device
    from memfit.memory.oom import is_oom
    from memfit.search.plan import Plan, plan
    from memfit.run.settings import Settings
    from memfit.run.steps import run_steps
    from memfit.units import format_size, parse_size
    from memfit.workload.spec import Workload, load_workload
