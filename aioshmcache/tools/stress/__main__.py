"""A child process of the harness (started by the parent only): :func:`.child.child_main`."""

import sys

from .child import child_main

sys.exit(child_main(sys.argv[1:]))
