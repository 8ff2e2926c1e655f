"""``python -m reclock ...`` is the ``reclock`` command."""

import sys

from reclock.cli import main

sys.exit(main())
