from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [path("health", views.health), path("payments", views.pay)]
