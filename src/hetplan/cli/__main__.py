"""``python -m hetplan.cli``: the same as the ``hetplan`` command."""

import sys

from hetplan.cli import main

sys.exit(main())
