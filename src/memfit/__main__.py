"""``python -m memfit`` (and ``torchrun -m memfit``) runs the command line.

Under torchrun (WORLD_SIZE > 1) the process first joins the process group, so every
command works the same way on every rank; rank 0 alone prints.
"""

from memfit.cli import exit_with
from memfit.integrations.torchrun import main

exit_with(main())
