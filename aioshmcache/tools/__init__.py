"""The tools behind ``python -m aioshmcache demo|bench|stress``, apart from the library.

The core never imports them (``aioshmcache.cli`` imports a tool inside its subcommand only);
they use only the public API, but for the stopgap :mod:`aioshmcache.tools._core_gaps`.
"""
