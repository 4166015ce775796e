"""The predicted GPU speed of each batch a probe tried, for its chart on a simulated GPU.

Why: on a simulated GPU a probe's trials time the CPU, which says nothing about a GPU's
speed, so its chart would plot the wrong machine. Like a plan on a simulated GPU, the chart
shows the speed predicted on the simulated GPU's card (or the one named) for every batch
that fit, fake trials included. It costs one fake step per batch size, so it is computed
only where a chart is drawn (``memfit probe --plot``, ``memfit fit``'s report), never for
the probe's own decision.
"""

from __future__ import annotations

from typing import Any

from memfit.memory.devices import Device
from memfit.memory.gpus import GPU
from memfit.run.settings import Settings
from memfit.search.plan_trials import speed_card
from memfit.workload import Workload

__all__ = ["with_predicted_speeds"]


def with_predicted_speeds(
    probe: dict[str, Any], workload: Workload, settings: Settings, device: Device, card: str | GPU | None = None
) -> dict[str, Any]:
    """``probe`` (a ``ProbeResult.to_dict()``) with ``predicted_samples_per_second`` on each
    trial that fit and ``speed_gpu`` naming the card; unchanged on a real GPU without ``card``,
    for a model instance (its fake steps would step the script's own optimizer), or where the
    prediction cannot run (``speed_error`` then says why).

    Args:
        probe: the probe's result as a dict.
        workload: the probed workload.
        settings: the settings it was probed with (the batch size is each trial's).
        device: the device the probe ran on.
        card: the card to predict on (default: a simulated GPU's own card, else none).
    """
    chosen = speed_card(device, card)
    if chosen is None or not workload.builds_fresh_models or settings.world_size > 1:
        return probe
    from memfit.estimator.speed import step_time

    speeds: dict[int, float] = {}
    try:
        for trial in probe.get("trials") or []:
            batch = trial.get("batch_size")
            if trial.get("fits") and isinstance(batch, int) and batch not in speeds:
                one = settings.replace(micro_batch_size=batch, accumulation_steps=1)
                speeds[batch] = step_time(workload, one, chosen).samples_per_second
    except Exception as error:  # noqa: BLE001 - a chart's extra line, never the probe's answer
        return {**probe, "speed_gpu": chosen.name, "speed_error": str(error).splitlines()[0] if str(error) else ""}
    trials = [
        {**t, "predicted_samples_per_second": speeds.get(t.get("batch_size"))} if t.get("fits") else dict(t)
        for t in probe.get("trials") or []
    ]
    return {**probe, "trials": trials, "speed_gpu": chosen.name}
