"""Workloads: one training step described so memfit can run it at any batch size.

- :mod:`memfit.workload.spec`: :class:`Workload` and the helpers every step uses;
- :mod:`memfit.workload.zoo`: the built-in workloads (``mlp``, ``gpt``, ``gpt2``, ...);
- :mod:`memfit.workload.gpt`: the zoo's pure-torch GPT decoder, the default workload's model;
- :mod:`memfit.workload.references`: :func:`load_workload` resolves a reference (zoo name,
  ``file.py:fn``, ``module:fn``);
- :mod:`memfit.workload.worst_case`: :func:`worst_case_batches`, a ``make_batch`` at a
  dataset's worst case (its largest samples, collated as training collates them).
"""

from memfit.workload.references import load_workload
from memfit.workload.spec import Workload, default_optimizer, move_to
from memfit.workload.worst_case import WorstCase, pad_collate, worst_case_batches

__all__ = [
    "Workload",
    "load_workload",
    "default_optimizer",
    "move_to",
    "WorstCase",
    "worst_case_batches",
    "pad_collate",
]
