"""The consumers' options refused at construction with what to change, and the package
importable without the brokers' extras."""

from __future__ import annotations

import subprocess
import sys

import pytest

from goblin_idem import MemoryStore
from goblin_idem.consumers import amqp, jetstream
from tests.support.procs import ROOT


async def handler(message: object) -> None:
    return None


@pytest.mark.parametrize("decorator", [amqp, jetstream])
def test_bad_options_are_refused_with_what_to_change(decorator: object) -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="max_deliveries must be >= 1"):
        decorator(store, max_deliveries=0)(handler)  # type: ignore[operator]
    with pytest.raises(TypeError, match="max_deliveries must be an int"):
        decorator(store, max_deliveries=2.5)(handler)  # type: ignore[operator]
    with pytest.raises(TypeError, match="key must be a function of the message"):
        decorator(store, key="message_id")  # type: ignore[operator]
    with pytest.raises(ValueError, match="requeue_delay_seconds must be >= 0"):
        decorator(store, requeue_delay_seconds=-1)  # type: ignore[operator]
    with pytest.raises(TypeError, match="on_event must be a function"):
        decorator(store, on_event=42)(handler)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("name", "client", "extra"), [("amqp", "aio_pika", "amqp"), ("jetstream", "nats", "nats")]
)
def test_without_its_extra_an_adapter_names_the_install(name: str, client: str, extra: str) -> None:
    """The package imports without the extras; the adapter that needs one says which."""
    script = (
        f"import sys; sys.modules[{client!r}] = None\n"
        "import goblin_idem.consumers as c\n"
        "try:\n"
        f"    c.{name}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert f"pip install 'goblin-idem[{extra}]'" in done.stdout, done.stderr
