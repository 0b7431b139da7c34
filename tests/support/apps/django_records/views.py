"""``POST /payments``: one payment through the ORM, and what its ``mode`` asks for."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, DatabaseError, IntegrityError, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from goblin_idem._keys import key_names

from .models import Payment, Ticket


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def pay(request: HttpRequest) -> HttpResponse:
    """Modes: ``gate`` (after the write, the run's n-th of its ref makes the file
    ``<ref>.entered.<n>`` in ``GATE_DIR`` and waits for ``<ref>.go.<n>`` there),
    ``nested`` (an atomic block, and one inside it that fails and is caught), ``other``
    (a second write through the alias ``other``), ``own`` (one through a connection the
    view makes, ``connections.create_connection``), ``hook`` (an on_commit callback that
    logs whether the key's record had committed), ``500`` (the same callback, then a
    500), ``hook-raises`` (a callback that raises, then that one), ``ticket`` (a ticket
    of ``code``, checked at COMMIT), ``set-rollback`` (the transaction marked for rollback
    after the write, and 201 all the same), ``gate-then-try`` (``gate``, then a second
    write through a cursor whose DatabaseError is caught), ``gate-then-save`` (the same
    through the ORM); ``work_ms`` is time the view works before its
    write."""
    body = json.loads(request.body or b"{}")
    ref, mode = body["ref"], body.get("mode")
    time.sleep(body.get("work_ms", 0) / 1000)
    if mode == "nested":
        with transaction.atomic():
            payment = Payment.objects.create(ref=ref, amount=body["amount"])
            try:
                with transaction.atomic():
                    Payment.objects.create(ref=f"{ref}-undone", amount=0)
                    raise IntegrityError("undone by its savepoint")
            except IntegrityError:
                pass
    else:
        payment = Payment.objects.create(ref=ref, amount=body["amount"])
    if mode == "ticket":
        Ticket.objects.create(code=body["code"])
    if mode == "set-rollback":  # the view undoes its writes, and answers as if it had not
        transaction.set_rollback(True)
    if mode == "other":
        Payment.objects.using("other").create(ref=f"{ref}-other", amount=0)
    if mode == "own":  # a connection of the view's own, in autocommit
        own = connections.create_connection(DEFAULT_DB_ALIAS)
        try:
            with own.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {Payment._meta.db_table} (ref, amount) VALUES (%s, 0)",
                    [f"{ref}-own"],
                )
        finally:
            own.close()
    if mode in ("hook", "500", "hook-raises"):
        key = request.headers.get("Idempotency-Key", "")
        if mode == "hook-raises":
            transaction.on_commit(_raise)
        transaction.on_commit(lambda: _log_hook(ref, key))
    _kill_after_commit()
    if mode in ("gate", "gate-then-try", "gate-then-save"):
        _gate(Path(os.environ["GATE_DIR"]), ref)
    if mode in ("gate-then-try", "gate-then-save"):  # a write the view can do without
        try:
            if mode == "gate-then-save":  # the ORM's: its error marks the block for rollback
                Payment.objects.create(ref=f"{ref}-optional", amount=0)
            else:
                with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO {Payment._meta.db_table} (ref, amount) VALUES (%s, 0)",
                        [f"{ref}-optional"],
                    )
        except DatabaseError:
            pass
    if mode == "500":
        return JsonResponse({"error": "failed"}, status=500)
    answer = {"ref": ref, "payment": payment.id, "run": uuid.uuid4().hex}
    return JsonResponse(answer, status=201, json_dumps_params={"separators": (",", ":")})


def _raise() -> None:
    raise RuntimeError("an on_commit callback that fails")


def _gate(directory: Path, ref: str) -> None:
    n = 1
    while True:
        try:
            (directory / f"{ref}.entered.{n}").touch(exist_ok=False)
            break
        except FileExistsError:
            n += 1
    go = directory / f"{ref}.go.{n}"
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _log_hook(ref: str, key: str) -> None:
    """An on_commit callback: whether the key's record is there, seen in autocommit."""
    from goblin_idem.django.models import Record

    result = key_names(b"idem", b"", key.encode()).result
    there = Record.objects.filter(key=result).exists()
    with open(os.environ["HOOK_LOG"], "a") as log:
        log.write(f"{ref} {'recorded' if there else 'unrecorded'}\n")


def _kill_after_commit() -> None:
    marker = os.environ.get("KILL_AFTER_COMMIT_FILE")
    if marker:

        def kill() -> None:
            if os.path.exists(marker):
                os.remove(marker)
                os.kill(os.getpid(), signal.SIGKILL)

        transaction.on_commit(kill)
