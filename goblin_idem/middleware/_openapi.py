"""What the middleware does, in a FastAPI app's OpenAPI document.

FastAPI builds the document from its routes, which know nothing of a middleware. The
middleware, when it first sees its app (the lifespan, or a first request), wraps the app's
``openapi`` method, as FastAPI's own docs do to extend the schema. Each operation is then
asked the middleware's own question, with a request made up from the operation's path: is
this method on this path covered, and is the key required there? `routes.settings` answers it
the way it does for a real request (options, path patterns, and the ``@idempotent`` mark of
the endpoint the router would pick), so the document cannot say anything else than what a
request meets. A covered operation gets the key header, the ``Idempotent-Replayed`` header
on the app's own responses, and the problem responses the middleware can give; a webhook
route gets its provider's headers instead of the key header.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _problems as problems
from .._routes import Routes

if TYPE_CHECKING:
    from ..webhooks import Provider

__all__ = ["PROBLEM_SCHEMA", "Coverage", "document_openapi", "idempotency_openapi"]

PROBLEM_SCHEMA = "IdempotencyProblem"
_BY = "__goblin_idem_openapi__"  # on the wrapper: the middleware it documents
_PATH_PARAM = re.compile(r"\{([^{}]+)\}")
_UUID = "00000000-0000-4000-8000-000000000000"


@dataclass(frozen=True, slots=True)
class Coverage:
    """What the document says of a middleware, in plain values: the methods it covers, its
    key header, whether any printable key is accepted, whether a store outage runs the
    handler (`fail_open`), and its routes (the settings a request meets)."""

    methods: frozenset[str]
    header_name: str
    any_key: bool
    fail_open: bool
    routes: Routes


def document_openapi(app: Any, mw: Coverage) -> None:
    """Wrap a FastAPI app's ``openapi`` (whatever it is now, FastAPI's or the app's own) so
    that the document it returns shows what `mw` does. Anything but a FastAPI app is left
    alone; FastAPI is not imported here."""
    fastapi = sys.modules.get("fastapi")
    if fastapi is None or not isinstance(app, fastapi.FastAPI):
        return
    inner = app.openapi
    if getattr(inner, _BY, None) is mw:
        return
    done: list[object] = []  # the document last completed (FastAPI caches it)

    def openapi() -> dict[str, Any]:
        schema: dict[str, Any] = inner()
        if not done or done[0] is not schema:
            idempotency_openapi(schema, app, mw)
            done[:] = [schema]
        return schema

    setattr(openapi, _BY, mw)
    app.openapi = openapi


def idempotency_openapi(schema: dict[str, Any], app: Any, mw: Coverage) -> None:
    """Add to `schema` (in place; doing it twice changes nothing) what `mw` does on each
    operation of `app`."""
    covered = False
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if method.upper() not in mw.methods or not isinstance(operation, dict):
                continue
            settings = mw.routes.settings(_request(app, method, path, operation, item))
            if settings is None:
                continue
            covered = True
            _document(operation, mw, settings.required, settings.webhook)
    if covered:
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas[PROBLEM_SCHEMA] = _PROBLEM


def _request(
    app: Any, method: str, path: str, operation: dict[str, Any], item: dict[str, Any]
) -> dict[str, Any]:
    """A request the operation serves: each path parameter given a value its converter
    accepts (digits suit int, float, str and path; a uuid needs a uuid)."""
    formats = {
        p.get("name"): p.get("schema", {}).get("format")
        for p in [*item.get("parameters", ()), *operation.get("parameters", ())]
        if isinstance(p, dict) and p.get("in") == "path"
    }
    concrete = _PATH_PARAM.sub(lambda m: _UUID if formats.get(m.group(1)) == "uuid" else "1", path)
    return {
        "type": "http",
        "method": method.upper(),
        "path": concrete,
        "raw_path": concrete.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "app": app,
    }


def _document(
    operation: dict[str, Any], mw: Coverage, required: bool, webhook: Provider | None = None
) -> None:
    name = mw.header_name
    headers = [_key_header(mw, required)] if webhook is None else _webhook_headers(webhook)
    names = {str(h["name"]).lower() for h in headers}
    parameters = operation.setdefault("parameters", [])
    parameters[:] = [
        p
        for p in parameters
        if not (p.get("in") == "header" and str(p.get("name", "")).lower() in names)
    ]
    parameters.extend(headers)
    if webhook is not None:
        name = f"{webhook.name} webhook"

    responses = operation.setdefault("responses", {})
    for response in responses.values():
        if isinstance(response, dict) and not _ours(response):
            response.setdefault("headers", {})["Idempotent-Replayed"] = _REPLAYED
    for status, cases in _cases(mw, required, webhook is not None).items():
        response = responses.setdefault(str(status), {"description": ""})
        content = response.setdefault("content", {})
        content["application/problem+json"] = {
            "schema": {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"},
            "examples": {
                p.slug: {
                    "summary": p.title,
                    "value": {"type": p.type, "title": p.title, "status": p.status},
                }
                for p in cases
            },
        }
        words = "; ".join(p.title for p in cases)
        ours = f"{name}: {words}"
        description = response.get("description", "")
        if ours not in description:
            response["description"] = f"{description} | {ours}" if description else ours
        if status in (409, 503):
            response.setdefault("headers", {})["Retry-After"] = _RETRY_AFTER


def _key_header(mw: Coverage, required: bool) -> dict[str, Any]:
    key_schema: dict[str, Any] = {"type": "string"}
    if mw.any_key:
        key_schema.update(minLength=1, maxLength=255)
    return {
        "name": mw.header_name,
        "in": "header",
        "required": required,
        "description": (
            "A key of the client's choosing, new for each new request and the same for "
            "each retry of it: the first request with a key runs, and every retry gets its "
            "response again, byte for byte, marked `Idempotent-Replayed: true`"
            + (". Required on this operation." if required else ".")
        ),
        "schema": key_schema,
    }


def _webhook_headers(provider: Provider) -> list[dict[str, Any]]:
    """The headers the provider sends and signs: the delivery is verified with them before
    anything runs, and runs once per delivery id."""
    return [
        {
            "name": header,
            "in": "header",
            "required": False,
            "description": f"Sent by {provider.name}: each delivery is verified by its "
            "signature before it runs, and runs once per delivery id.",
            "schema": {"type": "string"},
        }
        for header in provider.headers
    ]


def _cases(mw: Coverage, required: bool, webhook: bool) -> dict[int, list[problems.Problem]]:
    """The problems the middleware can answer on an operation, by status."""
    if webhook:
        cases = [problems.WEBHOOK_MALFORMED, problems.WEBHOOK_UNVERIFIED]
    else:
        cases = [problems.INVALID_KEY]
    if required and not webhook:
        cases.insert(0, problems.MISSING_KEY)
    cases += [
        problems.IN_FLIGHT,
        problems.NOT_REPLAYABLE,
        problems.BODY_TOO_LARGE,
        problems.KEY_REUSED,
    ]
    if not mw.fail_open:  # open, a store that is down runs the handler unprotected
        cases.append(problems.STORE_UNAVAILABLE)
    by_status: dict[int, list[problems.Problem]] = defaultdict(list)
    for problem in cases:
        by_status[problem.status].append(problem.for_header(mw.header_name))
    return dict(sorted(by_status.items()))


def _ours(response: dict[str, Any]) -> bool:
    """A response only the middleware gives (the app's own may share its status)."""
    content = response.get("content") or {}
    return list(content) == ["application/problem+json"] and PROBLEM_SCHEMA in str(content)


_REPLAYED = {
    "description": "`true` when this is a replay of the response to the first request "
    "with the same key (absent on the first response)",
    "schema": {"type": "string", "enum": ["true"]},
}
_RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same key",
    "schema": {"type": "integer", "minimum": 0},
}
_PROBLEM = {
    "title": "Idempotency problem",
    "description": "A response of the idempotency middleware, an RFC 9457 problem document. "
    f"`type` names the case ({problems.TYPE_BASE}<case>), `detail` says what to do.",
    "type": "object",
    "properties": {
        "type": {"type": "string", "format": "uri-reference"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string", "format": "uri-reference"},
    },
    "required": ["type", "title", "status", "detail"],
}
