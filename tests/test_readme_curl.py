"""The example app page's curl blocks as a reader pastes them: each one whole, into bash,
against ``python -m example_app``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.procs import ROOT, start_example_app, stop
from tests.support.servers import free_port

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")


def curl_block(containing: str) -> list[str]:
    """The commands of the block of "Trying it with curl" that shows `containing`."""
    page = (ROOT / "docs" / "example-app.md").read_text()
    section = page[page.index("## Trying it with curl") :]
    blocks = re.findall(r"```console\n(.*?)```", section, re.S)
    (block,) = [b for b in blocks if containing in b]
    return [line.removeprefix("$ ") for line in block.splitlines() if line.startswith("$ ")]


def test_the_in_flight_pair_pasted_as_one_block_gets_409(tmp_path: Path) -> None:
    """The duplicate must reach the server while the first request holds the claim; pasted
    at once, the two curls race for it (the one sent second often wins). Pasted five times
    over (at once, each with its own key), it is the 409 each time."""
    commands = curl_block("409 Conflict")
    port = free_port()
    app = start_example_app(port, tmp_path / "app.log")
    pastes: list[subprocess.Popen[bytes]] = []
    try:
        for paste in range(5):
            script = "\n".join(commands).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            script = script.replace("order-1043", f"order-1043-{paste}") + "\nwait\n"
            pastes.append(
                subprocess.Popen(  # bash waits for the background curl
                    ["bash", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
                )
            )
        for done in pastes:
            out = done.communicate(timeout=60)[0].decode()
            head, _, body = out.partition("\r\n\r\n")
            assert head.split("\r\n")[0] == "HTTP/1.1 409 Conflict", out
            assert "retry-after: 1" in head.split("\r\n"), out
            assert json.loads(body)["type"] == "urn:goblin-idem:problem:in-flight"
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()["middleware"]
        assert (stats["claimed"], stats["in_flight"]) == (5, 5)  # each first one ran once
    finally:
        for paste in pastes:
            stop(paste)
        stop(app)
