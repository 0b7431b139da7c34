"""Importing a part whose extra is not installed says which extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "missing", "extra"),
    [
        ("goblin_idem.sql", "sqlalchemy", "sql"),
        ("goblin_idem.sql", "greenlet", "sql"),  # SQLAlchemy without its asyncio half
        ("goblin_idem.client", "httpx", "client"),
        ("goblin_idem.grpc", "grpc", "grpc"),
    ],
)
def test_a_missing_extra_is_named(module: str, missing: str, extra: str) -> None:
    # A module set to None in sys.modules cannot be imported: as if it were not installed.
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"pip install 'goblin-idem[{extra}]'" in last
