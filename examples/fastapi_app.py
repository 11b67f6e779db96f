"""The FastAPI example gateway: its code is ``aioshmcache/tools/demo/app.py``, imported here.

    uvicorn --loop uvloop --app-dir examples fastapi_app:app --host 127.0.0.1 --port 8000
    python examples/fastapi_app.py --engine --group mm --socket /tmp/mm.sock   # a group's engine

Why it lives in the package: ``python -m aioshmcache demo`` runs this same app under uvicorn
and drives its load at it, so there is one gateway implementation, and the demo works from an
installed wheel too. Read that module for the whole integration (docs/fastapi.md explains it
piece by piece); ``examples/minimal_app.py`` is the same integration in one screen.
"""

from __future__ import annotations

from aioshmcache.tools.demo.app import (
    BAD_INPUT,
    MAX_BODY_BYTES,
    MAX_PIXELS,
    app,
    engine_main,
    group_engine_main,
    image_hash,
    main,
    preprocess,
    tensor_crc,
)

__all__ = [
    "BAD_INPUT",
    "MAX_BODY_BYTES",
    "MAX_PIXELS",
    "app",
    "engine_main",
    "group_engine_main",
    "image_hash",
    "main",
    "preprocess",
    "tensor_crc",
]

if __name__ == "__main__":
    main()
