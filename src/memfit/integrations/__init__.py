"""memfit where people already train: Lightning, the transformers Trainer, and torchrun.

Each integration is its own module, imported on demand so memfit never needs the
framework it is not used with:

- :mod:`memfit.integrations.lightning`: ``MemfitCallback`` (probe at fit start, guard
  each training step, log memory per step);
- :mod:`memfit.integrations.transformers`: ``MemfitTrainer`` (a ``Trainer`` whose
  training step survives OOMs) and ``MemoryCallback`` (memory per step in the logs);
- :mod:`memfit.integrations.torchrun`: joining the process group torchrun describes,
  this rank's device, printing on rank 0 only.

>>> import memfit.integrations
>>> memfit.integrations.__name__
'memfit.integrations'
"""
