"""``python -m tools.cli``: the ``statectl`` command."""

import sys

from tools.cli import main

sys.exit(main())
