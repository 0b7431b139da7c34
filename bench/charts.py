"""Draw the benchmark and reliability figures as SVG, from the result files beside this script.

    python bench/charts.py              # writes docs/img/http-ratios.svg, docs/img/reliability.svg
    python bench/charts.py --out DIR

It reads ``bench/results/http.json`` (``http_bench.py --results`` writes it: the medians of
each variant and scenario) and ``bench/results/reliability.json`` (``reliability.py`` writes
it with docs/RELIABILITY.md: each scenario's figures). Needs matplotlib (the ``docs`` extra).
The SVGs carry no date, so that drawing the same results again changes no byte.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
OUT = ROOT / "docs" / "img"
SCENARIOS = {"new": "new key", "replay": "replay", "nokey": "no key"}
COLOURS = {"new": "#d95f02", "replay": "#1b9e77", "nokey": "#7570b3"}
ANSWERS = {"2xx": "#1b9e77", "409": "#e6ab02", "503": "#d95f02"}


def save(fig: Any, path: Path) -> None:
    plt.rcParams["svg.hashsalt"] = "goblin-idem"  # stable ids: the same results, the same file
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def http_ratios(results: dict[str, Any], path: Path) -> None:
    """Each variant's throughput and p99 latency as ratios to the bare app's, by scenario."""
    rows = [r for r in results["rows"] if r["variant"] != "bare" and r["scenario"] in SCENARIOS]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.75 * len(labels) + 1.6), sharey=True)
    height = 0.8 / len(SCENARIOS)
    for ax, field, title in (
        (axes[0], "rps_ratio", "throughput / bare app (higher is better)"),
        (axes[1], "p99_ratio", "p99 latency / bare app (lower is better)"),
    ):
        for i, (scenario, name) in enumerate(SCENARIOS.items()):
            ys, values = [], []
            for y, label in enumerate(labels):
                for r in rows:
                    if r["label"] == label and r["scenario"] == scenario and r[field] is not None:
                        ys.append(y + (i - 1) * height)
                        values.append(r[field])
            bars = ax.barh(ys, values, height, label=name, color=COLOURS[scenario])
            ax.bar_label(bars, fmt="%.2fx", padding=2, fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.15)
    axes[0].set_yticks(range(len(labels)), [textwrap.fill(label, 34) for label in labels])
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    env = results["environment"]
    fig.suptitle(f"One uvicorn worker, wrk -c50; the bare app = 1.0 ({env[0]})", fontsize=9)
    save(fig, path)


def answers(figures: dict[str, Any]) -> dict[str, int] | None:
    """How a scenario's requests were answered: 2xx (a run or a replay), 409, 503."""
    counts = figures.get("status_counts")
    if isinstance(counts, dict) and counts:
        return {
            "2xx": sum(v for k, v in counts.items() if str(k).startswith("2")),
            "409": counts.get("409", 0),
            "503": counts.get("503", 0),
        }
    runs = figures.get("originals", figures.get("original"))
    replays = figures.get("replays", figures.get("replayed"))
    if runs is None or replays is None or "in_flight_409" not in figures:
        return None
    return {
        "2xx": runs + replays,
        "409": figures["in_flight_409"],
        "503": figures.get("store_unavailable_503", 0),
    }


def reliability(results: dict[str, Any], path: Path) -> None:
    """For each load scenario: keys that ran twice, and how its requests were answered."""
    entries = []
    for entry in results["entries"]:
        figures = entry["figures"]
        twice = figures.get("duplicate_runs", figures.get("second_runs"))
        if twice is not None and "requests" in figures:
            entries.append((entry["title"], figures, twice, answers(figures)))
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 0.42 * len(entries) + 1.4), sharey=True, width_ratios=[1, 1.3]
    )
    ys = range(len(entries))
    twice = [e[2] for e in entries]
    bars = left.barh(ys, twice, color=["#d95f02" if n else "#1b9e77" for n in twice])
    left.bar_label(bars, [str(n) for n in twice], padding=3, fontsize=8)
    left.set_title("keys that ran twice", fontsize=10)
    left.margins(x=0.2)
    left.set_yticks(list(ys), [textwrap.fill(e[0], 60) for e in entries], fontsize=7)
    left.invert_yaxis()
    start = [0.0] * len(entries)
    for kind, colour in ANSWERS.items():
        shares = [
            100 * e[3][kind] / e[1]["requests"] if e[3] and e[1]["requests"] else 0.0
            for e in entries
        ]
        right.barh(ys, shares, left=start, color=colour, label=kind)
        start = [a + b for a, b in zip(start, shares, strict=True)]
    for y, entry in zip(ys, entries, strict=True):
        if entry[3] is None:
            right.text(1, y, f"{entry[1]['requests']:,} requests", va="center", fontsize=7)
    right.set_title("how requests were answered (% of requests)", fontsize=10)
    right.set_xlim(0, 100)
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=3, fontsize=8)
    fig.suptitle(f"{results['command']}, {results['date']}", fontsize=9)
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    http = json.loads((args.results / "http.json").read_text())
    http_ratios(http, args.out / "http-ratios.svg")
    failures = json.loads((args.results / "reliability.json").read_text())
    reliability(failures, args.out / "reliability.svg")
    print(f"wrote {args.out / 'http-ratios.svg'} and {args.out / 'reliability.svg'}")


if __name__ == "__main__":
    main()
