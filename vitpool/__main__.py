"""`python -m vitpool`: the command line (`vitpool.cli`)."""

import sys

from vitpool.cli import main

sys.exit(main())
