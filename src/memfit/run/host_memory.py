"""Host memory: a real trial must not exhaust the machine memfit runs on.

A real trial builds the model on the host (in fp32, before moving it), and on a
simulated GPU (``sim:``) or the CPU every tensor of the step lives in host memory: up to
the simulated card's capacity: weights, gradients and AdamW's two states at least.
``memfit plan llama-7b --gpu "RTX 4090"`` built 27 GB of parameters for real on a machine
with less, until the kernel's OOM killer ended it (and maybe other processes with it).
Before a command runs real steps, the bytes they need are weighed against what the host
has available (``MemAvailable``, through the seam :func:`memfit.environment.system.current_probe`),
and a command whose real steps would not fit is refused in one line before any is run
(probe confirms its answer with real steps whatever ``--trials`` says). Plan
asks through :attr:`memfit.search.trials.Trials.host_shortfall`: on fake trials ranked by a card's
predicted speed it needs no real step, and its answer then says it was not confirmed for real.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from memfit.environment import system
from memfit.errors import MemfitError
from memfit.units import format_size

if TYPE_CHECKING:
    from memfit.memory.devices import Device
    from memfit.workload import Workload

__all__ = ["parameter_bytes", "host_bytes_needed", "host_fits", "check_host_memory", "host_refusal"]

#: bytes per fp32 parameter on a host that holds the whole step: weights, gradients, AdamW's two states
_STEP_BYTES_PER_PARAMETER_BYTE = 4
#: of the host's available memory, the share a trial may take (the rest: the interpreter, torch, the OS)
_HOST_SHARE = 0.9


def parameter_bytes(workload: Workload) -> int | None:
    """The model's parameter and buffer bytes, counted on the meta device (nothing allocated).

    None when the model cannot be built there (a factory that loads a checkpoint): the real
    build is then the first to know, as before.

    Args:
        workload: the workload whose model a trial would build.
    """
    import torch

    if not workload.builds_fresh_models:
        return None  # an instance: already in memory, nothing more to build
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = workload.build_model()
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
    except Exception:  # noqa: BLE001 - the user's factory under meta: not countable, not an error here
        return None


def host_bytes_needed(device: Device, parameters: int) -> int:
    """Host bytes real steps need at least: the model built on the host (fp32), and, where the
    step's tensors live in host memory (``sim:``, ``cpu``), weights, gradients and AdamW's two
    states (on ``sim:`` at most the card's memory). Activations are left out: they depend on
    the batch, and a search's batches are what the simulated card bounds.

    Args:
        device: where the steps run.
        parameters: the model's parameter bytes.
    """
    if device.torch_device.type != "cpu":
        return parameters  # a real GPU: only the build happens on the host
    state = parameters * _STEP_BYTES_PER_PARAMETER_BYTE
    if device.capacity:  # sim: what does not fit the simulated card fails as an OOM there, not here
        return max(parameters, min(state, device.capacity))
    return state


def host_fits(device: Device, workload: Workload) -> tuple[bool, str]:
    """(whether real steps fit in the host's available memory, the sentence saying how much each is)."""
    facts = system.current_probe().host()
    parameters = parameter_bytes(workload)
    if facts.ram_available is None or parameters is None:
        return True, ""
    needed = host_bytes_needed(device, parameters)
    allowed = int(facts.ram_available * _HOST_SHARE)
    what = (
        f"real steps of {workload.name} on {device.spec} need about {format_size(needed)} of host memory "
        f"(parameters {format_size(parameters)}), more than the {format_size(facts.ram_available)} this machine "
        "has available"
    )
    return needed <= allowed, what


def check_host_memory(device: Device, workload: Workload) -> None:
    """Refuse, in one line, real steps the host cannot hold (before any is run).

    Args:
        device: where the steps run.
        workload: what they run.
    """
    fits, what = host_fits(device, workload)
    if not fits:
        raise host_refusal(what)


def host_refusal(what: str) -> MemfitError:
    """The one-line refusal of real steps the host cannot hold, and what to do instead.

    Args:
        what: the sentence of :func:`host_fits` saying how much they need.
    """
    return MemfitError(
        f"{what}: use `memfit estimate` (fake tensors, nothing built), a smaller --device sim:SIZE, "
        "or a machine with more memory"
    )
