"""Broker consumers under randomized faults, at a chosen size and seed.

    python bench/consumer_faults.py [--seed 20261207] [--messages 400] [--duration 15]
                                    [--workers 2] [--fault-gap 1.5] [--kill-chance 0.01]
                                    [--no-records]

The scenario of ``tests/consumers/test_stream_faults.py`` (``tests/consumers/stream_faults.py``):
a Redis Streams consumer group of worker processes writing a row per message to PostgreSQL,
while a seeded schedule restarts the store empty and SIGKILLs workers (also right after
their commit, before their ack), and the producer publishes a share of its messages twice.
It prints the figures as JSON: duplicate effects and lost messages. With ``--no-records``
each row commits on its own before the result is stored: the control, where a store restart
lets a copy run again. Exit status 1 if records let a duplicate or a loss through.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.consumers.stream_faults import Options, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--duplicates", type=float, default=0.25)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fault-gap", type=float, default=1.5)
    parser.add_argument("--kill-chance", type=float, default=0.01)
    parser.add_argument("--no-records", action="store_true", help="the control: no records")
    args = parser.parse_args()
    outcome = run(
        Options(
            seed=args.seed,
            messages=args.messages,
            duplicates=args.duplicates,
            duration=args.duration,
            workers=args.workers,
            fault_gap=args.fault_gap,
            kill_chance=args.kill_chance,
            records=not args.no_records,
        )
    )
    print(json.dumps(outcome.as_json(), indent=2))
    broken = outcome.duplicates or outcome.lost or not outcome.settled
    return 1 if broken and not args.no_records else 0


if __name__ == "__main__":
    raise SystemExit(main())
