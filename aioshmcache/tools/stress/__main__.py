"""Entry point of the harness's child processes (the parent runs ``-m`` on this package)."""

import sys

from .entry import child_main

sys.exit(child_main(sys.argv[1:]))
