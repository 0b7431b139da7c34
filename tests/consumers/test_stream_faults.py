"""A Redis Streams consumer group under randomized faults (tests/consumers/stream_faults.py):
the store restarted empty, workers SIGKILLed, workers SIGKILLed after their commit and
before their ack, a producer publishing a quarter of its messages twice.

With records on PostgreSQL no message has two effects and none is lost; without records,
the control, the store's restarts let copies run again. ``bench/consumer_faults.py`` runs
the same scenario at a chosen size and seed.
"""

from __future__ import annotations

import os

import pytest

from tests.consumers.stream_faults import Options, run

SEED = int(os.environ.get("GOBLIN_FAULTS_SEED", "20261207"))
SMALL = {"messages": 200, "duration": 8.0, "fault_gap": 1.0}


@pytest.mark.timeout(240)
def test_random_faults_with_records_one_effect_per_message() -> None:
    outcome = run(Options(seed=SEED, records=True, **SMALL))  # type: ignore[arg-type]
    assert outcome.settled, outcome.as_json()
    assert outcome.faults["store restarted empty"] > 0, outcome.as_json()
    assert (outcome.duplicates, outcome.lost) == (0, 0), outcome.as_json()
    assert outcome.effects == outcome.distinct


@pytest.mark.timeout(240)
def test_random_faults_without_records_show_the_duplicates_records_prevent() -> None:
    outcome = run(Options(seed=SEED, records=False, **SMALL))  # type: ignore[arg-type]
    assert outcome.settled, outcome.as_json()
    assert outcome.lost == 0, outcome.as_json()
    assert outcome.duplicates > 0, outcome.as_json()
