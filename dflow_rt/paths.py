"""Where the project keeps what it fetches and builds: one root every cache hangs under."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$DFLOW_RT_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/dflow-rt`: read at call time, so tests can move it."""
    if os.environ.get("DFLOW_RT_CACHE"):
        return Path(os.environ["DFLOW_RT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflow-rt"
