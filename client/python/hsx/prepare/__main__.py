"""Entry point of `python -m hsx.prepare` (see hsx.prepare.cli)."""

import sys

from .cli import main

sys.exit(main())
