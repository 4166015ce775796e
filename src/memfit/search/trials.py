"""What one trial of probe and plan runs: fake tensors on a simulated GPU, else real steps.

Why fake tensors: on ``sim:`` a real trial runs the whole training step on the CPU, which
takes seconds to minutes at a batch that fills 8 GiB; the same step on fake tensors
(:func:`memfit.estimator.fake.run_fake_steps`: shapes only, no arithmetic) goes through
the same storage tracker and the same caching-allocator model with the device's budget,
so it says "fits" or "out of memory", with the same peaks, in a fraction of a second at
any batch size. The search runs on fake trials; probe and plan then confirm their final
answer with real runs on the simulated GPU.

Real trials everywhere fake tensors cannot stand in for the device:

- a real GPU (fake tensors would only repeat the allocator model, the GPU *is* the truth),
  and the unlimited ``cpu`` device (nothing runs out there; the CPU's speed is the point);
- a workload whose model is an instance (not a factory): it comes with the script's own
  optimizer, bound to the real parameters, which a fake run must not step;
- a step fake tensors cannot run (an operation without a fake implementation, a read of a
  tensor's value): the trial runs for real and every later one too, and :attr:`Trials.note`
  says why.

A fake trial's :class:`~memfit.run.measure.Measurement` has ``fake=True`` and no time
(``seconds_per_step`` None): fake tensors do no arithmetic, so their wall time says nothing
about a GPU's.

>>> import memfit
>>> trials = choose_trials("auto", memfit.load_workload("mlp:layers=1,width=16,features=8"), memfit.device("sim:64MiB"))
>>> trials.fake, trials(8).fake, trials(8).fits
(True, True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

from memfit.errors import MemfitError
from memfit.estimator.fake import run_fake_steps
from memfit.memory.devices import Device, SimDevice
from memfit.run.host_memory import host_fits, host_refusal
from memfit.run.measure import Measurement, measure
from memfit.run.settings import Settings
from memfit.units import format_size
from memfit.workload import Workload

__all__ = [
    "TrialKind",
    "TRIAL_KINDS",
    "Trials",
    "choose_trials",
    "fake_measure",
    "fake_trials_unavailable",
    "trial_line",
]

#: ``auto``: fake tensors on a simulated GPU, real steps elsewhere; ``fake``: fake tensors
#: wherever they can stand in for the device; ``real``: every trial runs the real step
TrialKind = Literal["auto", "fake", "real"]
TRIAL_KINDS: tuple[TrialKind, ...] = ("auto", "fake", "real")

#: ``say(line)``: one line for people (why the trials went real)
Say = Callable[[str], None]


def fake_trials_unavailable(workload: Workload, device: Device, settings: Settings | None = None) -> str | None:
    """Why fake trials cannot stand in for real ones here, or None when they can."""
    if settings is not None and settings.world_size > 1:
        # A fake trial runs one GPU's step; a rank of several is rehearsed with real
        # tensors on a fake process group, wrapped as the strategy wraps it.
        return f"one rank of {settings.world_size} is rehearsed on a fake process group"
    if not isinstance(device, SimDevice):
        return f"{device.spec} is a real device: trials run there"
    if device.capacity is None:
        return "the cpu device has no memory limit: trials measure the CPU itself"
    if not workload.builds_fresh_models:
        return (
            "the workload's model is an instance, with the script's own optimizer bound to its real "
            "parameters, which a fake-tensor run must not step"
        )
    return None


def fake_measure(
    workload: Workload, batch_size: int, device: Device, settings: Settings | None = None, *, steps: int = 2
) -> Measurement:
    """:func:`memfit.measure` on fake tensors: fits and peaks under ``device``'s budget, no time.

    The accounting is the simulated GPU's (the same tracker and allocator model, the
    optimizer's CPU implementation), so on a ``sim:`` device the answer is what a real
    trial measures. Raises whatever the step raises on fake tensors (an OOM is a result).
    """
    settings = (settings or Settings()).replace(micro_batch_size=batch_size)
    # The device's own CUDA semantics (attention kernels, autocast lists): a simulated GPU
    # runs its real steps under them, so its fake ones must too.
    semantics = device.cuda if isinstance(device, SimDevice) else None
    run = run_fake_steps(workload, settings, steps=steps, budget=device.capacity, cuda=semantics)
    return Measurement(batch_size, run.fits, run.peak_allocated, run.peak_reserved, None, fake=True)


class Trials:
    """``trials(batch_size) -> Measurement``: one trial, on fake tensors while they can run it.

    ``fake`` says whether the trials started on fake tensors; ``note`` is None, or why
    they are (now) real. :meth:`real` runs one trial for real, always (the confirmations).
    """

    def __init__(
        self,
        workload: Workload,
        device: Device,
        settings: Settings | None = None,
        *,
        steps: int = 2,
        fake: bool,
        note: str | None = None,
        say: Say | None = None,
    ) -> None:
        self.workload, self.device, self.settings, self.steps = workload, device, settings or Settings(), steps
        self.fake = fake
        self.note = note
        self._say = say
        self._fallen_back = not fake

    @functools.cached_property
    def host_shortfall(self) -> str | None:
        """None when real steps fit in this host's available memory; else the sentence saying
        how much they need (:func:`memfit.run.host_memory.host_fits`), and :meth:`real` refuses."""
        fits, what = host_fits(self.device, self.workload)
        return None if fits else what

    @property
    def on_fake_tensors(self) -> bool:
        """True while trials still run on fake tensors (not fallen back to real steps)."""
        return not self._fallen_back

    def __call__(self, batch_size: int, settings: Settings | None = None) -> Measurement:
        settings = settings or self.settings
        if self._fallen_back:
            return self.real(batch_size, settings)
        try:
            return fake_measure(self.workload, batch_size, self.device, settings, steps=self.steps)
        except Exception as error:  # noqa: BLE001 - the real step decides (below)
            problem = f"{type(error).__name__}: {error}".splitlines()[0]
        # Outside the except block. A bug in the user's step fails the real step too and
        # propagates from there, with the user's own traceback; a step only fake tensors
        # cannot run is measured for real, and so is every trial after it.
        measured = self.real(batch_size, settings)
        self._fallen_back = True
        self.tell(f"fake tensors cannot run this step ({problem}); trials run for real")
        return measured

    def tell(self, note: str) -> None:
        """Record ``note`` (why the trials are real, or were run again) and say it."""
        self.note = note
        if self._say is not None:
            self._say(note)

    def real(self, batch_size: int, settings: Settings | None = None) -> Measurement:
        """One trial of the real step on the device; refused in one line when the host cannot hold it."""
        if self.host_shortfall is not None:
            raise host_refusal(self.host_shortfall)
        return measure(self.workload, batch_size, self.device, settings or self.settings, steps=self.steps)


def choose_trials(
    kind: TrialKind,
    workload: Workload,
    device: Device,
    settings: Settings | None = None,
    *,
    steps: int = 2,
    say: Say | None = None,
) -> Trials:
    """The trials probe and plan run: fake tensors where they stand in for ``device``.

    Args:
        kind: ``"auto"`` (fake on a simulated GPU), ``"fake"`` (the same, and say why
            not where they cannot run), or ``"real"``.
        workload: the workload the trials run.
        device: where real trials run, and whose budget fake trials use.
        settings: precision, checkpointing and accumulation (the batch is the trial's).
        steps: optimizer steps per trial.
        say: receives one line when the trials are real for a reason worth telling.
    """
    if kind not in TRIAL_KINDS:
        raise MemfitError(f"invalid trials {kind!r}: use one of {', '.join(TRIAL_KINDS)}")
    if kind == "real":
        return Trials(workload, device, settings, steps=steps, fake=False, say=say)
    why_not = fake_trials_unavailable(workload, device, settings)
    if why_not is not None:
        trials = Trials(workload, device, settings, steps=steps, fake=False, say=say)
        # Asked for fake trials, or a simulated GPU where people expect them: say why not.
        if kind == "fake" or (isinstance(device, SimDevice) and device.capacity is not None):
            trials.tell(f"real trials: {why_not}")
        return trials
    return Trials(workload, device, settings, steps=steps, fake=True, say=say)


def trial_line(measurement: Measurement) -> str:
    """One trial for a progress line: the verdict, the memory, the speed, and what ran it.

    >>> trial_line(Measurement(64, True, 2**20, 2**21, 0.5))
    'fits, 2.00 MiB reserved, 128.0 samples/s'
    >>> trial_line(Measurement(64, False, 2**20, 2**21, None, fake=True))
    'out of memory (fake tensors)'
    """
    if not measurement.fits:
        line = "out of memory"
    else:
        line = f"fits, {format_size(measurement.peak_reserved)} reserved"
        if measurement.samples_per_second:
            line += f", {measurement.samples_per_second:.1f} samples/s"
    return line + (" (fake tensors)" if measurement.fake else "")
