"""memfit: end "CUDA out of memory" in PyTorch training.

The public API is the names in ``__all__``; everything else lives in the subpackages
(``memfit.memory``, ``memfit.estimator``, ...) for those who need the parts. Each name is
imported on first use, so ``import memfit`` and ``memfit doctor`` stay fast.

>>> import memfit
>>> memfit.measure("mlp:layers=2,width=64", batch_size=16, device="sim:1GiB").fits
True
"""

from __future__ import annotations

# Nothing is imported here, not even typing: the ``memfit`` command imports this package
# before its signal handlers are in place (memfit/__main__.py), so this module is that
# window; ``__version__`` (importlib.metadata, tens of milliseconds) comes on first use too.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read it as True)

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "__version__": "memfit._version",
    # errors and sizes
    "MemfitError": "memfit.errors",
    "DoesNotFitError": "memfit.errors",
    "format_size": "memfit.units",
    "is_oom": "memfit.memory.oom",
    # what to run, and where
    "Workload": "memfit.workload",
    "load_workload": "memfit.workload",
    "Settings": "memfit.run.settings",
    "device": "memfit.memory.devices",
    # how much memory, how many samples
    "measure": "memfit.run.measure",
    "Measurement": "memfit.run.measure",
    "estimate": "memfit.estimator.estimate",
    "Estimate": "memfit.estimator.estimate",
    "probe": "memfit.search.probe",
    "ProbeResult": "memfit.search.probe",
    "plan": "memfit.search.plan",
    "Plan": "memfit.search.plan",
    "fit": "memfit.search.fit",
    "FitResult": "memfit.search.fit",
    "Lock": "memfit.search.lock",
    "load_lock": "memfit.search.lock",
    "check_lock": "memfit.search.lock",
    # while training
    "Guard": "memfit.guard",
    "Monitor": "memfit.monitor.monitor",
    "read_run": "memfit.monitor.runfile",
    "write_report": "memfit.reporting.pages",
    # the environment
    "diagnose": "memfit.environment.doctor",
    "export_environment": "memfit.environment.envfile",
    "check_environment": "memfit.environment.envfile",
}

__all__ = [
    "__version__",
    "MemfitError",
    "DoesNotFitError",
    "format_size",
    "is_oom",
    "Workload",
    "load_workload",
    "Settings",
    "device",
    "measure",
    "Measurement",
    "estimate",
    "Estimate",
    "probe",
    "ProbeResult",
    "plan",
    "Plan",
    "fit",
    "FitResult",
    "Lock",
    "load_lock",
    "check_lock",
    "Guard",
    "Monitor",
    "read_run",
    "write_report",
    "diagnose",
    "export_environment",
    "check_environment",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from memfit._version import __version__
    from memfit.environment.doctor import diagnose
    from memfit.environment.envfile import check_environment, export_environment
    from memfit.errors import DoesNotFitError, MemfitError
    from memfit.estimator.estimate import Estimate, estimate
    from memfit.guard import Guard
    from memfit.memory.devices import device
    from memfit.memory.oom import is_oom
    from memfit.monitor.monitor import Monitor
    from memfit.monitor.runfile import read_run
    from memfit.reporting.pages import write_report
    from memfit.run.measure import Measurement, measure
    from memfit.run.settings import Settings
    from memfit.search.fit import FitResult, fit
    from memfit.search.lock import Lock, check_lock, load_lock
    from memfit.search.plan import Plan, plan
    from memfit.search.probe import ProbeResult, probe
    from memfit.units import format_size
    from memfit.workload import Workload, load_workload
