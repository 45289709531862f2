"""python -m workbench: the command line (workbench.cli)."""
import sys

from .cli import MODULE_PROG, main

sys.exit(main(prog=MODULE_PROG))
