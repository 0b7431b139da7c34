"""Command line: `python -m goblin_idem <command>` (see cli.py)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
