"""`python -m ddtree ...`: the same as the `ddtree` console script (ddtree.cli:main)."""

import sys

from ddtree.cli import main

if __name__ == "__main__":
    sys.exit(main())
