"""`python -m headroom.engine.server ...`: the same flags as `headroom serve`."""

import sys

from headroom.engine.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
