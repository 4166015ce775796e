"""Workloads: one training step described so memfit can run it at any batch size.

- :mod:`memfit.workload.spec`: :class:`Workload` and the helpers every step uses;
- :mod:`memfit.workload.zoo`: the built-in workloads (``mlp``, ``gpt``, ``gpt2``, ...);
- :mod:`memfit.workload.gpt`: the zoo's pure-torch GPT decoder, the default workload's model;
- :mod:`memfit.workload.references`: :func:`load_workload` resolves a reference (zoo name,
  ``file.py:fn``, ``module:fn``).
"""

from memfit.workload.references import load_workload
from memfit.workload.spec import Workload, default_optimizer, move_to

__all__ = ["Workload", "load_workload", "default_optimizer", "move_to"]
