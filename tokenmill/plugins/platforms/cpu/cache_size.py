"""The CPU's last-level cache, for choices that depend on whether the weights stay cached."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


@functools.cache
def last_level_cache_bytes() -> Optional[int]:
    """The size of cpu0's highest-level data or unified cache (Linux sysfs), or None where the
    kernel does not say (another OS, some containers)."""
    best: tuple[int, int] | None = None
    for index in _CACHES.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            size = int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]
