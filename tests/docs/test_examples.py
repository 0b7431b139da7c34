"""Every Python and shell block of README.md and docs/ runs as printed (see examples.py for
how a page is run, and the conventions its blocks follow)."""

from __future__ import annotations

import site
import subprocess
from pathlib import Path

import pytest

from tests.docs.examples import BASE, PAGES, blocks, install_line, matches, run_page, venv_python
from tests.support.postgres import Postgres
from tests.support.procs import ROOT
from tests.support.servers import Server


def runnable(page: Path) -> bool:
    return any(block.runs for block in blocks(page))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_block_of_the_page_runs(
    page: Path, redis_server: Server, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with redis_server.sync_client() as client:
        client.flushall()
    postgres_url = None
    if "POSTGRES_URL" in page.read_text():  # a PostgreSQL only for the pages that use one
        postgres: Postgres = request.getfixturevalue("postgres")
        postgres_url = f"postgresql://postgres@127.0.0.1:{postgres.port}/{postgres.new_database()}"
    ran = list(run_page(page, redis_server.url, tmp_path, postgres_url))
    assert ran


def test_every_install_line_is_one_a_reader_runs() -> None:
    """A page's install line comes before its first block that runs, and the line for a
    checkout names what the line for once it is published names."""
    for page in PAGES:
        install_line(blocks(page))


def test_a_page_venv_sees_nothing_of_the_test_run() -> None:
    """What a page's blocks import is what its install line installed: not the test run's
    packages (pytest, the extras' packages)."""
    python = venv_python(BASE)
    code = "import sys; print(sys.prefix); print(*sys.path, sep='\\n')"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    prefix, *path = done.stdout.splitlines()
    assert prefix == str(python.parent.parent)
    assert not set(path) & set(site.getsitepackages())
    for name in ("pytest", "sqlalchemy", "fastapi"):
        imported = subprocess.run([python, "-c", f"import {name}"], capture_output=True, timeout=60)
        assert imported.returncode != 0, name


def test_only_the_ci_command_is_not_run() -> None:
    """The one block the tests cannot run is the command that runs them."""
    skipped = [b for page in PAGES for b in blocks(page) if b.directive.startswith("not run")]
    assert [b.body.strip() for b in skipped] == ["bash .ci/run"], [b.where for b in skipped]


def test_a_transcript_matches_in_order_with_lines_left_out() -> None:
    output = 'HTTP/1.1 201 Created\r\ndate: Tue\r\nlocation: /p/1\r\n\r\n{"id": 7}\r\n'
    assert matches(["HTTP/1.1 201 Created", "location: /p/1", '{"id": ...}'], output) is None
    assert matches(["location: /p/1", "HTTP/1.1 201 Created"], output) == "HTTP/1.1 201 Created"
    assert matches(['{"id": 8}'], output) == '{"id": 8}'
