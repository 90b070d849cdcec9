"""``python -m fisherprune`` (also what ``torchrun -m fisherprune`` runs)."""

import sys

from fisherprune.cli.main import main

sys.exit(main())
