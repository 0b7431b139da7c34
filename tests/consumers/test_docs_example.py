"""docs/consumers.md's RabbitMQ example, run as printed against the tests' RabbitMQ node
(the docs' own run has no RabbitMQ: it starts in seconds and needs ports of its own beyond
what a page can name), with the python of the venv that the page's install line makes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.docs.examples import blocks, install_line, venv_python
from tests.support.brokers import RabbitMQ
from tests.support.procs import ROOT
from tests.support.servers import Server


@pytest.mark.timeout(600)  # the page's venv, when this run is the first to need it
def test_the_rabbitmq_example_runs_once_per_message_id(
    rabbitmq_server: RabbitMQ, redis_server: Server, tmp_path: Path
) -> None:
    page = blocks(ROOT / "docs" / "consumers.md")
    [block] = [b for b in page if b.title == "amqp_consumer.py"]
    script = tmp_path / "amqp_consumer.py"
    script.write_text(block.body)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "REDIS_URL": redis_server.url,
        "AMQP_URL": rabbitmq_server.url,
    }
    done = subprocess.run(
        [venv_python(install_line(page)), str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['ada@example.com']"
