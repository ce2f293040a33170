"""`python -m weft ...` runs the weft command line."""

from __future__ import annotations

import sys

from weft.cli import main

sys.exit(main())
