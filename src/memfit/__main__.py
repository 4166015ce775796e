"""``python -m memfit`` (and ``torchrun -m memfit``) runs the command line."""

from memfit.cli import entry_point

entry_point()
