"""memfit: end "CUDA out of memory" in PyTorch training.

>>> import memfit
>>> result = memfit.measure("mlp:layers=2,width=64", batch_size=16, device="sim:1GiB")
>>> result.fits
True
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("memfit")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

from memfit.errors import DeviceError, DoesNotFitError, MemfitError, WorkloadError
from memfit.measurement import Measurement, measure
from memfit.memory.devices import CudaDevice, Device, SimDevice, device
from memfit.oom import is_oom
from memfit.settings import Settings
from memfit.training import run_steps
from memfit.units import format_size, parse_size
from memfit.workload import Workload, load_workload

__all__ = [
    "__version__",
    "CudaDevice",
    "Device",
    "DeviceError",
    "DoesNotFitError",
    "MemfitError",
    "Measurement",
    "Settings",
    "SimDevice",
    "Workload",
    "WorkloadError",
    "device",
    "format_size",
    "is_oom",
    "load_workload",
    "measure",
    "parse_size",
    "run_steps",
]
