"""Sync SQL records under gunicorn (sync and gthread workers) on PostgreSQL (psycopg): Flask
with Flask-SQLAlchemy (``db.session``, its views committing) and a plain WSGI app
(``goblin_idem.sql.sync.session()``), tests/support/apps/sync_sql_app.py. A replay from the
database once the store lost everything; a claim deleted mid-run, whichever run commits
first; a worker SIGKILLed right after its commit; a commit that fails; a commit outside the
run, named in the server's log."""

from __future__ import annotations

import http.client
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from goblin_idem._keys import key_names
from tests.sql.conftest import SyncSetup, on_sync_postgres
from tests.support.procs import output_of
from tests.support.servers import free_port
from tests.support.wsgi import Gunicorn

APPS = {
    "flask": "tests.support.apps.sync_sql_app:flask_app",
    "flask-first": "tests.support.apps.sync_sql_app:flask_first_app",  # before db.init_app
    "wsgi": "tests.support.apps.sync_sql_app:wsgi_app",
}
# (worker class, workers, threads): two requests at once either way.
WORKERS = {"sync": ("sync", 2, 1), "gthread": ("gthread", 1, 4)}

pytestmark = on_sync_postgres


def post(
    port: int, ref: str, key: str | None = None, mode: str = ""
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        body = json.dumps({"ref": ref, "amount": 7, "mode": mode})
        conn.request("POST", "/payments", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def serve(app: str, workers: str, env: dict[str, str]) -> Gunicorn:
    worker_class, n, threads = WORKERS[workers]
    return Gunicorn(
        APPS[app], free_port(), env, worker_class=worker_class, workers=n, threads=threads
    ).wait_ready()


@pytest.fixture
def gates(tmp_path: Path) -> Path:
    where = tmp_path / "gates"
    where.mkdir()
    return where


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("app", APPS)
def test_a_completed_run_replays_from_the_database_once_the_store_is_flushed(
    sync_setup: SyncSetup, app: str, workers: str
) -> None:
    server = serve(app, workers, sync_setup.env())
    try:
        assert post(server.port, "nokey")[0] == 201  # committed as a request of its own
        key = f"pay-{secrets.token_hex(4)}"
        status, _, body = post(server.port, "keyed", key)
        assert status == 201
        with sync_setup.redis.sync_client() as client:
            client.flushall()
        status, headers, again = post(server.port, "keyed", key)
        assert status == 201 and headers.get("idempotent-replayed") == "true" and again == body
    finally:
        server.stop()
    assert sync_setup.payment_count("nokey") == 1 and sync_setup.payment_count("keyed") == 1
    assert len(sync_setup.rows()) == 1


@pytest.mark.parametrize("second_commits", ["first", "first-store-lost-it", "second"])
@pytest.mark.parametrize(
    ("app", "workers"),
    [
        ("flask", "sync"),
        ("flask", "gthread"),
        ("flask-first", "gthread"),
        ("wsgi", "sync"),
        ("wsgi", "gthread"),
    ],
)
def test_a_claim_deleted_mid_run_commits_one_effect_and_both_get_one_answer(
    sync_setup: SyncSetup, gates: Path, app: str, workers: str, second_commits: str
) -> None:
    """Two runs of one key (the first's claim deleted while it ran, after its write), in
    two workers or threads: the key's row stops the later commit, which answers the
    earlier run's record. When the second commits first, the first's log says its own
    commit was refused (also when the store lost the second's result, and its claim is
    what the first finds when it publishes)."""
    server = serve(app, workers, {**sync_setup.env(), "GATE_DIR": str(gates)})
    key = f"mid-{secrets.token_hex(4)}"
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.port, "a", key, "gate")
            wait_for(gates / "reached-a-0")
            with sync_setup.redis.sync_client() as client:
                client.delete(*client.keys("*:c"))
            second = pool.submit(post, server.port, "a", key, "gate")
            wait_for(gates / "reached-a-1")  # the second run claimed the key and wrote
            runs = (first, second)
            order = (0, 1) if second_commits == "second" else (1, 0)
            (gates / f"go-a-{order[0]}").touch()
            done = runs[order[0]].result(timeout=30)
            assert done[0] == 201 and done[1].get("idempotent-replayed") != "true"
            if second_commits == "first-store-lost-it":
                with sync_setup.redis.sync_client() as client:
                    assert client.delete(key_names(b"idem", b"", key.encode()).result) == 1
            (gates / f"go-a-{order[1]}").touch()
            one, two = first.result(timeout=30), second.result(timeout=30)
        said = output_of(server.proc)
    finally:
        server.stop()
    assert one[0] == two[0] == 201 and one[2] == two[2]
    assert sync_setup.payment_count("a") == 1 and len(sync_setup.rows()) == 1
    # The run that commits second is the one refused; the first, if it found the claim
    # taken when it published, says the other's commit will be.
    refused = [line for line in said.splitlines() if "this run's commit was refused" in line]
    assert len(refused) == 1, said
    assert ("its commit will find this run's record" in said) == (second_commits == "second")


@pytest.mark.parametrize(("app", "workers"), [("flask", "sync"), ("wsgi", "gthread")])
def test_a_worker_killed_right_after_its_commit_replays_once_after_the_lease(
    sync_setup: SyncSetup, tmp_path: Path, app: str, workers: str
) -> None:
    armed = tmp_path / "kill-after-commit"
    env = {**sync_setup.env(), "LEASE_SECONDS": "1", "KILL_AFTER_COMMIT_FILE": str(armed)}
    server = serve(app, workers, env)
    key = f"crash-{secrets.token_hex(4)}"
    try:
        armed.touch()
        with pytest.raises((http.client.HTTPException, OSError)):
            post(server.port, "c1", key)  # the worker dies after its commit: no response
        assert not armed.exists() and sync_setup.payment_count("c1") == 1
        deadline = time.monotonic() + 20
        status, headers, body = post(server.port, "c1", key)
        while status == 409 and time.monotonic() < deadline:  # until the dead run's lease ends
            time.sleep(0.1)
            status, headers, body = post(server.port, "c1", key)
        assert status == 201 and headers.get("idempotent-replayed") == "true"
        assert json.loads(body)["ref"] == "c1"
        assert post(server.port, "c1", key)[2] == body
    finally:
        server.stop()
    assert sync_setup.payment_count("c1") == 1 and len(sync_setup.rows()) == 1


@pytest.mark.parametrize(("app", "workers"), [("flask", "gthread"), ("wsgi", "sync")])
def test_a_commit_that_fails_under_gunicorn_is_a_503_and_the_retry_runs(
    sync_setup: SyncSetup, app: str, workers: str
) -> None:
    sync_setup.defer_a_unique_ref("taken")
    server = serve(app, workers, sync_setup.env())
    key = f"late-{secrets.token_hex(4)}"
    try:
        status, headers, body = post(server.port, "taken", key)
        assert status == 503 and json.loads(body)["type"].endswith("not-committed")
        assert headers.get("retry-after") is not None
        assert sync_setup.payment_count("taken") == 1 and sync_setup.rows() == []
        with sync_setup.engine.begin() as conn:
            conn.execute(sync_setup.payments.delete())
        status, headers, _ = post(server.port, "taken", key)
        assert status == 201 and headers.get("idempotent-replayed") != "true"
    finally:
        server.stop()
    assert sync_setup.payment_count("taken") == 1 and len(sync_setup.rows()) == 1


def test_a_flask_view_committing_through_its_own_connection_is_named_in_the_log(
    sync_setup: SyncSetup,
) -> None:
    server = serve("flask", "gthread", sync_setup.env())
    try:
        for n in range(2):
            assert post(server.port, f"own{n}", f"own-{secrets.token_hex(4)}", "own")[0] == 201
    finally:
        log = output_of(server.proc)
        server.stop()
    told = [line for line in log.splitlines() if "a commit on the records' database" in line]
    assert len(told) == 1, log
    assert "WARNING" in told[0] and "goblin_idem.sql: POST /payments: a commit" in told[0]
    assert "db.session joins the run" in told[0]
    assert sync_setup.payment_count() == 2


@pytest.mark.parametrize("app", APPS)
def test_preloaded_workers_do_not_share_the_masters_connection(
    sync_setup: SyncSetup, gates: Path, app: str
) -> None:
    """gunicorn --preload: the records' startup check (and Flask-SQLAlchemy's) runs in the
    master and leaves a connection in the engine's pool, which every forked worker would
    take as its own: one database session for two processes, one worker's statements in
    the other's transaction (a 500, or another run's writes committed). Each worker opens
    its own."""
    env = {**sync_setup.env(), "GATE_DIR": str(gates)}
    server = Gunicorn(APPS[app], free_port(), env, workers=2, preload=True).wait_ready()
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, server.port, "held", "k-held", "gate")
            wait_for(gates / "reached-held-0")  # one worker, in its run's transaction
            others = [post(server.port, "other", "k-other"), post(server.port, "nokey")]
            (gates / "go-held-0").touch()
            done = held.result(timeout=30)
    finally:
        server.stop()
    assert [done[0]] + [status for status, _, _ in others] == [201, 201, 201], (done, others)
    for ref in ("held", "other", "nokey"):
        assert sync_setup.payment_count(ref) == 1, ref
    assert len(sync_setup.rows()) == 2
