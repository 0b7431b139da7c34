"""bench/charts.py draws both charts from the committed result files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT


def test_the_charts_are_drawn_from_the_result_files(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "charts.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    for name in ("http-ratios.svg", "reliability.svg"):
        drawn = (tmp_path / name).read_text()
        assert drawn.startswith("<?xml") and "<svg" in drawn, name
        assert (ROOT / "docs" / "img" / name).is_file(), f"docs/img/{name} is not committed"
