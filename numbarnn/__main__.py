"""`python -m numbarnn` = the `numbarnn` command (see numbarnn/cli.py)."""
import sys

from .cli import main

sys.exit(main())
