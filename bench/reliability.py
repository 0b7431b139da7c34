"""Run the reliability suite at full size and write its figures to docs/RELIABILITY.md.

The scenarios are the tests in ``tests/reliability/test_*.py``. CI runs them at the small
size (``GOBLIN_RELIABILITY_SCALE`` unset); this script runs them with
``GOBLIN_RELIABILITY_SCALE=full`` and ``GOBLIN_RELIABILITY_REPORT`` pointing at a scratch file,
into which every scenario appends one JSON line of figures, and renders those lines, the
test outcomes and the machine's description as Markdown. Every server and app process a
scenario starts runs on 127.0.0.1 and is stopped by PID when the scenario ends.

Usage (from the project root, with the test extras installed):

    python bench/reliability.py                   # full size, writes docs/RELIABILITY.md
                                                  # and bench/results/reliability.json
    python bench/reliability.py --scale small     # the CI size, same report format
    python bench/reliability.py -k storm --out /tmp/storm.md

It exits with pytest's status: non-zero if any scenario's assertions failed (the report is
written either way, and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "RELIABILITY.md"
DEFAULT_RESULTS = ROOT / "bench" / "results" / "reliability.json"  # bench/charts.py reads it

# Report order, and the figures that make each scenario's summary line.
SCENARIOS: list[tuple[str, str, list[str]]] = [
    ("storm", "1. Storm", ["requests", "side_effects", "duplicate_runs", "in_flight_409"]),
    ("crash", "2. Crash", ["keys", "side_effects", "completed_max_after_kill_s", "superseded"]),
    ("outage", "3. Store outage", ["requests", "within_outage_503", "duplicate_runs"]),
    ("network", "4. Slow / flaky network", ["requests", "second_runs", "store_errors"]),
    (
        "cluster",
        "5. Redis Cluster",
        ["requests", "duplicate_runs", "silent_loss_duplicates", "503_answers"],
    ),
    ("failover", "5. Redis Cluster", ["requests", "duplicate_runs", "silent_loss_duplicates"]),
    ("fuzz", "6. Fuzz", ["examples"]),
    ("isolation", "7. Isolation", ["pairs", "requests"]),
    ("memory", "8. Memory", ["keys", "keys_total", "used_memory_per_key"]),
    (
        "sqlfaults",
        "9. SQL records under faults",
        ["requests", "keys", "faults", "duplicate_effects"],
    ),
]


def machine() -> dict[str, str]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    redis_server = shutil.which("redis-server")
    redis_version = ""
    if redis_server:
        out = subprocess.run([redis_server, "--version"], capture_output=True, text=True)
        redis_version = out.stdout.split(" v=", 1)[-1].split()[0] if " v=" in out.stdout else ""
    import redis

    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-server": redis_version,
        "redis-py": redis.__version__,
    }


def run_suite(scale: str, report: Path, junit: Path, extra: list[str]) -> int:
    env = {
        **os.environ,
        "GOBLIN_RELIABILITY_SCALE": scale,
        "GOBLIN_RELIABILITY_REPORT": str(report),
    }
    tests = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "reliability").glob("test_*.py")
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "timeout=900",
        f"--junitxml={junit}",
        *tests,
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def outcomes(junit: Path) -> list[dict[str, str]]:
    if not junit.exists():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = "FAILED", (child.get("message") or "")[:200]
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if "xfail" in kind else "skipped"
                detail = child.get("message") or ""
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        rows.append(
            {"test": name, "outcome": outcome, "seconds": case.get("time", ""), "detail": detail}
        )
    return rows


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (dict, list)) and not value:
        return "none"
    if isinstance(value, float):
        return f"{value:,.2f}".rstrip("0").rstrip(".") if value % 1 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def render(
    entries: list[dict[str, Any]],
    tests: list[dict[str, str]],
    *,
    scale: str,
    command: str,
    started: str,
    seconds: float,
    status: int,
) -> str:
    out = [
        "# Reliability",
        "",
        "What the middleware does on a bad day, in figures: concurrent duplicates over several",
        "worker processes, workers killed mid-handler, the store going away, a slow and flaky",
        "network, Redis Cluster failovers, fuzzed input, tenant isolation and memory. Each",
        "scenario is a test in `tests/reliability/test_*.py` that asserts what must hold and",
        "reports what it measured; CI runs every one of them at a small size, and this file is",
        "the full-size run. Timings are what this machine measured, not targets.",
        "",
        f"- command: `{command}`",
        f"- date: {started}",
        f"- size: `GOBLIN_RELIABILITY_SCALE={scale}`; wall time {seconds:.0f} s",
        f"- result: {'all scenarios passed' if status == 0 else f'pytest exit status {status}'}",
    ]
    m = machine()
    out.append(
        f"- machine: {m['cpus']} CPUs ({m['cpu']}), {m['os']}, Python {m['python']}, "
        f"redis-server {m['redis-server']}, redis-py {m['redis-py']}"
    )
    out += [
        "",
        "Re-run one scenario at full size with",
        "`GOBLIN_RELIABILITY_SCALE=full python -m pytest -s tests/reliability/test_<name>.py`",
        "(`-s` prints each scenario's figures as one JSON line).",
        "",
        "## Summary",
        "",
        "| scenario | figures | test |",
        "|---|---|---|",
    ]
    by_prefix: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        prefix = next((p for p, _, _ in SCENARIOS if entry["scenario"].startswith(p)), "other")
        by_prefix.setdefault(prefix, []).append(entry)
    for prefix, _, keys in SCENARIOS:
        for entry in by_prefix.get(prefix, []):
            figures = entry["figures"]
            shown = ", ".join(f"{k} {fmt(figures[k])}" for k in keys if k in figures)
            out.append(f"| {entry['title']} | {shown} | `{entry['test']}` |")
    seen_headings: set[str] = set()
    for prefix, heading, _ in SCENARIOS:
        for entry in by_prefix.get(prefix, []):
            if heading not in seen_headings:
                seen_headings.add(heading)
                out += ["", f"## {heading}"]
            out += ["", f"### {entry['title']}", "", f"Test: `{entry['test']}`", ""]
            if entry["checks"]:
                out.append("Asserted:")
                out += [f"- {c}" for c in entry["checks"]]
                out.append("")
            out += ["| figure | value |", "|---|---|"]
            out += [f"| {k} | {fmt(v)} |" for k, v in entry["figures"].items()]
            if entry["notes"]:
                out.append("")
                out += [f"Note: {n}" for n in entry["notes"]]
    out += [
        "",
        "## Test outcomes",
        "",
        "An `xfailed` test reproduces a known defect and fails as expected until it is fixed.",
        "",
        "| test | outcomes (cases) | seconds | detail |",
        "|---|---|---|---|",
    ]
    grouped: dict[str, dict[str, Any]] = {}
    for row in tests:  # parametrized cases of one test function share a row
        name = row["test"].split("[", 1)[0]
        group = grouped.setdefault(name, {"outcomes": {}, "seconds": 0.0, "detail": ""})
        group["outcomes"][row["outcome"]] = group["outcomes"].get(row["outcome"], 0) + 1
        group["seconds"] += float(row["seconds"] or 0)
        group["detail"] = group["detail"] or row["detail"].replace("|", "/").replace("\n", " ")
    for name, group in grouped.items():
        outcome = ", ".join(f"{n} {o}" for o, n in group["outcomes"].items())
        out.append(f"| `{name}` | {outcome} | {group['seconds']:.1f} | {group['detail']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["small", "full"], default="full")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("-k", dest="select", help="run only the scenarios pytest -k selects")
    parser.add_argument(
        "--results",
        type=Path,
        help="the figures as JSON, for bench/charts.py "
        f"(default: {DEFAULT_RESULTS.relative_to(ROOT)} when --out is the default)",
    )
    args = parser.parse_args()
    extra = ["-k", args.select] if args.select else []
    command = "python bench/reliability.py" + (
        f" --scale {args.scale}" if args.scale != "full" else ""
    )
    if args.select:
        command += f" -k {args.select!r}"
    with tempfile.TemporaryDirectory(prefix="goblin-reliability-") as scratch:
        report = Path(scratch) / "figures.jsonl"
        junit = Path(scratch) / "junit.xml"
        started = time.strftime("%Y-%m-%d %H:%M %Z")
        t0 = time.monotonic()
        status = run_suite(args.scale, report, junit, extra)
        seconds = time.monotonic() - t0
        entries = (
            [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
            if report.exists()
            else []
        )
        text = render(
            entries,
            outcomes(junit),
            scale=args.scale,
            command=command,
            started=started,
            seconds=seconds,
            status=status,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    results = args.results or (DEFAULT_RESULTS if args.out == DEFAULT_OUT else None)
    if results is not None:
        figures = {
            "command": command,
            "date": started,
            "size": args.scale,
            "seconds": round(seconds),
            "status": status,
            "machine": machine(),
            "entries": entries,
        }
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {args.out} ({len(entries)} scenario reports, {seconds:.0f} s)")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
