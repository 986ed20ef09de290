"""`python -m zeroshard.cli ...`: the same as the `zeroshard` command."""

from __future__ import annotations

import sys

from zeroshard.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
