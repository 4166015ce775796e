"""Running a workload: settings, training steps, one measurement, state save/restore.

- :mod:`memfit.run.settings`: :class:`Settings` and how each is applied;
- :mod:`memfit.run.steps`: ``run_steps``, k optimizer steps on a device;
- :mod:`memfit.run.measure`: ``measure``, one batch size -> fits, peaks, speed;
- :mod:`memfit.run.state`: model, optimizer and RNG state saved and restored bit for bit.
"""
