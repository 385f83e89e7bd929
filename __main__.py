"""`python -m splitserve` is the `splitserve` command."""

import sys

from splitserve.cli import main

sys.exit(main())
