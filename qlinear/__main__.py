"""``python -m qlinear``: the :mod:`qlinear.cli` command line."""

import sys

from qlinear.cli import main

sys.exit(main())
