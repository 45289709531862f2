"""python -m workbench: the command line (workbench.cli)."""
import sys

from .cli import main

sys.exit(main())
