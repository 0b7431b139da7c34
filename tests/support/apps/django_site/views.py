"""The test project's views: each run counted in the store's server (``runs:<key>``) or,
without one, in the process."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views import View
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from goblin_idem import current_claim
from goblin_idem.django import idempotent
from goblin_idem.webhooks import GitHub, StandardWebhooks, webhook
from tests.support.apps import counting
from tests.support.apps.webhook_app import GITHUB_SECRETS, STANDARD_SECRETS


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def work(request: HttpRequest) -> HttpResponse:
    """Counts its run, works for the Work-Ms header's milliseconds (a header, so that a
    retry of the request may work less), checks its claim, answers 201."""
    key = request.headers.get("Idempotency-Key", "-")
    run = counting.count(key)
    counting.note(f"pid:{key}", os.getpid())  # the worker a test may kill mid-run
    time.sleep(int(request.headers.get("Work-Ms", "0")) / 1000)
    claim = current_claim()
    if claim is not None:
        claim.ensure_owned()
    body = json.loads(request.body or b"{}")
    return JsonResponse({"pid": os.getpid(), "run": run, "body": body}, status=201)


def fail(request: HttpRequest) -> HttpResponse:
    counting.count(request.headers.get("Idempotency-Key", "-"))
    return HttpResponse("down", status=int(request.GET.get("status", "503")))


def stream(request: HttpRequest) -> StreamingHttpResponse:
    counting.count(request.headers.get("Idempotency-Key", "-"))
    size = int(request.GET.get("kb", "4"))
    return StreamingHttpResponse(
        (b"x" * 1024 for _ in range(size)), status=201, content_type="text/plain"
    )


def cookie(request: HttpRequest) -> HttpResponse:
    counting.count(request.headers.get("Idempotency-Key", "-"))
    response = HttpResponse("with cookies", status=201)
    response.set_cookie("session", "s1", httponly=True)
    response.set_cookie("theme", "dark", samesite="Lax")
    return response


@idempotent(required=True)
def required(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"run": counting.count(request.headers.get("Idempotency-Key", "-"))})


@idempotent(required=True)
class MarkedView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        key = request.headers.get("Idempotency-Key", "-")
        return JsonResponse({"run": counting.count(key)}, status=201)


class PaymentsAPI(APIView):
    @idempotent(required=True)
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "-")
        return Response({"run": counting.count(key), "data": request.data}, status=201)

    def patch(self, request: Request) -> Response:  # not marked: the defaults apply
        key = request.headers.get("Idempotency-Key", "-")
        return Response({"run": counting.count(key)})


class OrdersViewSet(viewsets.ViewSet):
    def create(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "-")
        return Response({"run": counting.count(key)}, status=201)

    @idempotent(required=True)
    @action(detail=True, methods=["post"])
    def refund(self, request: Request, pk: Any = None) -> Response:
        key = request.headers.get("Idempotency-Key", "-")
        return Response({"run": counting.count(key), "order": pk}, status=201)


def form(request: HttpRequest) -> HttpResponse:
    """Reads the form the middleware has read as the body already."""
    counting.count(request.headers.get("Idempotency-Key", "-"))
    return JsonResponse({"name": request.POST.get("name")}, status=201)


def tenant(scope: dict[str, Any]) -> str:
    """A scope= function (by dotted path in GOBLIN_IDEM): the request's tenant header."""
    request: HttpRequest = scope["django.request"]
    return request.headers.get("X-Tenant", "")


def store() -> object:
    """A STORE factory (by dotted path in GOBLIN_IDEM)."""
    from goblin_idem import MemoryStore

    return MemoryStore()


def cached_store() -> object:
    """A STORE factory: REDIS_URL's store with a replay cache of REPLAY_CACHE_BYTES."""
    from goblin_idem import RedisStore

    budget = int(os.environ["REPLAY_CACHE_BYTES"])
    return RedisStore.from_url(os.environ["REDIS_URL"], replay_cache_bytes=budget)


def _hook(request: HttpRequest) -> HttpResponse:
    event = json.loads(request.body)
    run = counting.count(f"hook:{event['ref']}")
    return JsonResponse({"run": run, "size": len(request.body)})


standard_hook = webhook(StandardWebhooks(secrets=STANDARD_SECRETS))(_hook)


class GitHubHookView(View):
    @webhook(GitHub(secrets=GITHUB_SECRETS))
    def post(self, request: HttpRequest) -> HttpResponse:
        return _hook(request)
