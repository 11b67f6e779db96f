"""The tools behind ``python -m aioshmcache demo|bench|stress``, apart from the library.

The core never imports them (``aioshmcache.cli`` imports a tool inside its subcommand only);
they use the public API, and of the private modules only the documented internal API that
docs/design.md lists for them ("Internal API for the tools"; tests/test_tools_boundary.py
holds them to it).
"""
