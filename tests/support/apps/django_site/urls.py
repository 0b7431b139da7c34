from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("orders", views.OrdersViewSet, basename="orders")

urlpatterns = [
    path("health", views.health),
    path("work", views.work),
    path("fail", views.fail),
    path("stream", views.stream),
    path("cookie", views.cookie),
    path("form", views.form),
    path("required", views.required),
    path("marked", views.MarkedView.as_view()),
    path("api/payments", views.PaymentsAPI.as_view()),
    path("api/", include(router.urls)),
    path("hooks/standard", views.standard_hook),
    path("hooks/github", views.GitHubHookView.as_view()),
]
