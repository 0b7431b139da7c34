"""RFC 9457 problem+json responses, one stable `type` per case the middleware answers itself."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from starlette.types import Send

__all__ = [
    "BODY_TOO_LARGE",
    "DATABASE_UNAVAILABLE",
    "INVALID_KEY",
    "IN_FLIGHT",
    "KEY_REUSED",
    "MISSING_KEY",
    "NOT_COMMITTED",
    "NOT_REPLAYABLE",
    "RECORD_UNREADABLE",
    "STORE_UNAVAILABLE",
    "TYPE_BASE",
    "WEBHOOK_MALFORMED",
    "WEBHOOK_UNVERIFIED",
    "Problem",
    "problem_body",
    "send_problem",
]

TYPE_BASE = "urn:goblin-idem:problem:"
DEFAULT_HEADER = "Idempotency-Key"  # the header the titles name


@dataclass(frozen=True, slots=True)
class Problem:
    slug: str
    status: int
    title: str

    @property
    def type(self) -> str:
        return TYPE_BASE + self.slug

    def for_header(self, header_name: str) -> Problem:
        """This problem with its title naming the key header the middleware is configured
        with (the titles name the default, Idempotency-Key)."""
        if header_name == DEFAULT_HEADER or DEFAULT_HEADER not in self.title:
            return self
        return dataclasses.replace(self, title=self.title.replace(DEFAULT_HEADER, header_name))


MISSING_KEY = Problem("missing-key", 400, "An Idempotency-Key header is required")
INVALID_KEY = Problem("invalid-key", 400, "The Idempotency-Key header is not valid")
BODY_TOO_LARGE = Problem("body-too-large", 413, "The request body is too large")
IN_FLIGHT = Problem(
    "in-flight", 409, "A request with this Idempotency-Key is still being processed"
)
NOT_REPLAYABLE = Problem(
    "not-replayable",
    409,
    "The request with this Idempotency-Key completed, but its response was too large to replay",
)
KEY_REUSED = Problem(
    "key-reused", 422, "This Idempotency-Key was already used for a different request"
)
RECORD_UNREADABLE = Problem(
    "record-unreadable",
    503,
    "The request with this Idempotency-Key was run, but its stored response cannot be read",
)
NOT_COMMITTED = Problem(
    "not-committed", 503, "The request's effects did not commit in the database; it was not run"
)
STORE_UNAVAILABLE = Problem(
    "store-unavailable", 503, "The idempotency store is unavailable; the request was not run"
)

WEBHOOK_UNVERIFIED = Problem(
    "webhook-unverified", 401, "The webhook delivery's signature could not be verified"
)
WEBHOOK_MALFORMED = Problem("webhook-malformed", 400, "The webhook delivery is malformed")
DATABASE_UNAVAILABLE = Problem(
    "database-unavailable", 503, "The records' database is unavailable; the request was not run"
)


def problem_body(problem: Problem, detail: str) -> bytes:
    """The problem+json document of `problem` (what `send_problem` sends)."""
    return json.dumps(
        {"type": problem.type, "title": problem.title, "status": problem.status, "detail": detail}
    ).encode()


async def send_problem(
    send: Send,
    problem: Problem,
    detail: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = problem_body(problem, detail)
    await send(
        {
            "type": "http.response.start",
            "status": problem.status,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
