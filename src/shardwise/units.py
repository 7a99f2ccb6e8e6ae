"""Numbers for people: counts and bytes as logs, dry runs and reports print them."""

from __future__ import annotations

import math

MIB = 2**20
GIB = 2**30


def human(n: float) -> str:
    """1234567 -> '1.23M' (parameter and token counts)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}" if not math.isclose(n, round(n)) else str(int(n))


def gib(n_bytes: float, digits: int = 2) -> str:
    """Bytes as GiB with `digits` decimals: 3221225472 -> '3.00 GiB'."""
    return f"{n_bytes / GIB:.{digits}f} GiB"


def size_text(n_bytes: float) -> str:
    """Bytes as GiB (2 decimals), or as MiB (1 decimal) below one GiB: '1.50 GiB', '512.0 MiB'."""
    return gib(n_bytes, 2) if n_bytes >= GIB else f"{n_bytes / MIB:.1f} MiB"
