"""`python -m leasework` is the `leasework` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
