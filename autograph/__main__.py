"""The command line: ``python -m autograph doctor`` checks this machine, ``python -m autograph
bench`` times eager against graphed on it, ``python -m autograph --version`` prints versions.

>>> main(["doctor"])              # what ``python -m autograph doctor`` runs
autograph 0.2.0.dev0, torch 2.11.0+cu130, Python 3.12.3
...
"""

import sys

from autograph.cli._main import main

if __name__ == "__main__":
    sys.exit(main())
