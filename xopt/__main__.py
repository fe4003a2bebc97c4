"""``python -m xopt`` is the ``xopt`` command."""

import sys

from xopt.cli import main

sys.exit(main())
