from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("work/<str:name>/", views.work),
    path("unlocked/<str:name>/", views.unlocked),
    path("limited/<str:name>/", views.limited),
    path("waits/<str:name>/", views.waits),
    path("stream/<str:name>/", views.stream),
]
