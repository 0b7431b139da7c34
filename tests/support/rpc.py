"""gRPC for the tests, the docs' examples and bench/: the test service's modules, compiled
from protos/payments.proto with grpcio-tools at first use (once per process, into a
temporary directory removed at exit), and a server of its own on a free loopback port.

The command, as a user would run it::

    python -m grpc_tools.protoc -I tests/support/protos --python_out=DIR \\
        --grpc_python_out=DIR tests/support/protos/payments.proto
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

PROTOS = Path(__file__).parent / "protos"
_lock = threading.Lock()
_compiled: Path | None = None


def compile_protos(out: Path) -> None:
    """payments_pb2.py and payments_pb2_grpc.py in `out`, by grpcio-tools' protoc."""
    from grpc_tools import protoc

    proto = PROTOS / "payments.proto"
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed ({status}) on {proto}")


def payments() -> tuple[ModuleType, ModuleType]:
    """The compiled modules (payments_pb2, payments_pb2_grpc), importable by their names."""
    global _compiled
    with _lock:
        if _compiled is None:
            out = Path(tempfile.mkdtemp(prefix="goblin-protos-"))
            atexit.register(shutil.rmtree, out, True)
            compile_protos(out)
            sys.path.insert(0, str(out))
            _compiled = out
    return importlib.import_module("payments_pb2"), importlib.import_module("payments_pb2_grpc")
