"""``python -m ddpkit train ...`` (also what ``torchrun -m ddpkit train ...`` runs on every rank)."""

import sys

from ddpkit.cli import main

sys.exit(main())
