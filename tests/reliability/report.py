"""Shared pieces of the reliability suite: the size switch and the figures it records.

``GOBLIN_RELIABILITY_SCALE`` chooses the size: ``small`` (the default, what CI runs) or
``full`` (what ``bench/reliability.py`` runs). When ``GOBLIN_RELIABILITY_REPORT`` names a
file, every scenario appends one JSON line with its figures to it; the report script
renders those lines as ``docs/RELIABILITY.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

SCALE = os.environ.get("GOBLIN_RELIABILITY_SCALE", "small").strip().lower() or "small"
if SCALE not in ("small", "full"):
    raise RuntimeError(f"GOBLIN_RELIABILITY_SCALE must be 'small' or 'full', not {SCALE!r}")
FULL = SCALE == "full"


def pick(small: T, full: T) -> T:
    """The small or the full size of a figure, by GOBLIN_RELIABILITY_SCALE."""
    return full if FULL else small


def record(
    scenario: str,
    title: str,
    figures: Mapping[str, Any],
    *,
    checks: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> None:
    """Print a scenario's figures and, if asked for, append them to the report file."""
    entry = {
        "scenario": scenario,
        "title": title,
        "scale": SCALE,
        "figures": dict(figures),
        "checks": list(checks),
        "notes": list(notes),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(f"\n[reliability] {scenario}: {json.dumps(entry['figures'], sort_keys=True)}")
    path = os.environ.get("GOBLIN_RELIABILITY_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")


def pct(values: Iterable[float], p: float) -> float:
    """The p-th percentile (nearest rank), 0.0 for no values."""
    data = sorted(values)
    if not data:
        return 0.0
    k = max(0, min(len(data) - 1, round(p / 100 * len(data) + 0.5) - 1))
    return data[k]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def latency_figures(prefix: str, seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {}
    return {
        f"{prefix}_p50_ms": ms(pct(seconds, 50)),
        f"{prefix}_p99_ms": ms(pct(seconds, 99)),
        f"{prefix}_max_ms": ms(max(seconds)),
    }


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0
