"""The estimator: a training step on fake tensors, its peak memory and what holds it.

- :mod:`memfit.estimator.fake`: the steps on fake tensors, every allocator event recorded;
- :mod:`memfit.estimator.breakdown`: the peak replayed and split by category;
- :mod:`memfit.estimator.sharding`: what one rank holds under ZeRO / FSDP (formulas);
- :mod:`memfit.estimator.estimate`: ``estimate``, the public entry point.
"""
