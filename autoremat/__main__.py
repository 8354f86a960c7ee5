"""`python -m autoremat ...`: the same as the `autoremat` console script."""

import sys

from autoremat.cli import main

if __name__ == "__main__":
    sys.exit(main())
