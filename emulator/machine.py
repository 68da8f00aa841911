"""The first line of every bench's output: where and when its figures were taken, as
bench/RESULTS.md records them beside each figure."""

from __future__ import annotations

import os
import platform
import time


def machine_line(note: str = "") -> str:
    """``# 2026-11-27 10:40 UTC host: 2 cores x86_64, Python 3.11.7`` and the bench's ``note``."""
    line = (
        f"# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC {platform.node()}: "
        f"{os.cpu_count()} cores {platform.machine()}, Python {platform.python_version()}"
    )
    return f"{line}; {note}" if note else line
