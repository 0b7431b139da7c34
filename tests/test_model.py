"""The claim protocol's model (docs/protocol.pml), explored exhaustively by SPIN.

Each configuration is checked twice: for safety (assertions (a)-(c) and invalid end states,
the never claim left out) and for liveness ((d): every client answered, under weak
fairness). The seeded bugs must each be caught, with a trail that SPIN replays into a
counterexample. docs/protocol.md says what each configuration stands for.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parent.parent / "docs" / "protocol.pml"
# The exhaustive runs take seconds; the bound only stops a model change that blows up.
DEPTH = "-m300000"

# The guarantee with SQL records: every fault at once, two clients.
RECORDS = ("-DRECORDS", "-DPUBFAILS=1")
# A store without records while leases hold and the store keeps its keys: three clients.
STORE_LEASES_HOLD = ("-DN=3", "-DLOSSES=0", "-DLAPSES=0", "-DCRASHES=0")
# A store without records under every fault: what still holds is (c) and (d).
STORE_FAULTS = ("-DNO_EFFECT_CHECKS", "-DPUBFAILS=1")


def build(tmp_path: Path, defines: tuple[str, ...]) -> tuple[Path, Path]:
    """The verifier of `defines`, compiled twice: without the never claim, and with it."""
    spin = shutil.which("spin")
    assert spin is not None, "SPIN is not installed: .ci/run installs Debian's spin package"
    model = tmp_path / MODEL.name
    shutil.copy(MODEL, model)
    subprocess.run([spin, "-a", *defines, model.name], cwd=tmp_path, check=True, timeout=60)
    safety, liveness = tmp_path / "pan-safety", tmp_path / "pan-liveness"
    for out, extra in ((safety, ["-DNOCLAIM"]), (liveness, [])):
        subprocess.run(
            ["cc", "-O2", *extra, "-o", str(out), "pan.c"], cwd=tmp_path, check=True, timeout=120
        )
    return safety, liveness


def verify(pan: Path, *flags: str) -> tuple[int, str]:
    """Run a verifier: the errors it found, and what it printed."""
    done = subprocess.run(
        [str(pan), DEPTH, *flags], cwd=pan.parent, capture_output=True, text=True, timeout=300
    )
    found = re.search(r"errors: (\d+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    assert "max search depth too small" not in done.stdout, done.stdout
    return int(found.group(1)), done.stdout


def counterexample(tmp_path: Path, defines: tuple[str, ...]) -> str:
    """SPIN's replay of the trail the last failing run wrote: the steps that lead to it."""
    trail = tmp_path / f"{MODEL.name}.trail"
    assert trail.exists()
    done = subprocess.run(
        ["spin", "-t", "-p", *defines, MODEL.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout


@pytest.mark.parametrize(
    "defines",
    [RECORDS, STORE_LEASES_HOLD, STORE_FAULTS],
    ids=["records-every-fault", "store-leases-hold", "store-every-fault"],
)
def test_the_protocol_holds(tmp_path: Path, defines: tuple[str, ...]) -> None:
    safety, liveness = build(tmp_path, defines)
    errors, out = verify(safety)
    assert errors == 0, out
    errors, out = verify(liveness, "-a", "-f")
    assert errors == 0, out


def test_without_records_a_crash_after_the_work_runs_it_twice(tmp_path: Path) -> None:
    """The boundary docs/guarantees.md states: without records, a run that dies after its
    effects and before its publish is run again once its lease expires."""
    defines = ("-DLOSSES=0", "-DLAPSES=0")
    safety, _ = build(tmp_path, defines)
    errors, out = verify(safety)
    assert errors == 1
    assert "assertion violated (effects<=1)" in out
    assert "crashes = 1" in counterexample(tmp_path, defines)


@pytest.mark.parametrize(
    ("defines", "violated"),
    [
        ((*RECORDS, "-DBUG_NO_FENCE"), "assertion violated (effects<=1)"),
        ((*RECORDS, "-DBUG_IGNORE_COMMITTED"), "assertion violated (first==data)"),
        (
            (*STORE_FAULTS, "-DBUG_PUBLISH_OVERWRITES"),
            "assertion violated ((before==0)||(result==before))",
        ),
    ],
    ids=["no-fence", "ignore-committed", "publish-overwrites"],
)
def test_a_seeded_safety_bug_is_caught(
    tmp_path: Path, defines: tuple[str, ...], violated: str
) -> None:
    safety, _ = build(tmp_path, defines)
    errors, out = verify(safety)
    assert errors == 1
    assert violated in out
    assert violated.replace("assertion violated ", "") in counterexample(tmp_path, defines)


def test_a_seeded_liveness_bug_is_caught(tmp_path: Path) -> None:
    """A failed run that keeps its lease renewed: every retry is answered 409 forever."""
    defines = (*RECORDS, "-DBUG_LEAKED_LEASE")
    safety, liveness = build(tmp_path, defines)
    assert verify(safety)[0] == 0  # safe, but never answers
    errors, out = verify(liveness, "-a", "-f")
    assert errors == 1
    assert "acceptance cycle" in out
    assert "START OF CYCLE" in counterexample(tmp_path, defines)
