"""A tiny Django site for tests/test_django.py: hotlock.django's views and checks.

CACHE_URL names the test's Redis (hotlock's default when HOTLOCK has no URL); CHECKER the
overlap checker's state file; HOTLOCK_JSON, when set, is the HOTLOCK setting itself.
"""

from __future__ import annotations

import json
import os

SECRET_KEY = "only-for-the-tests-" + "x" * 40
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = ["hotlock.django"]
ROOT_URLCONF = "tests.webapps.django_site.urls"
MIDDLEWARE: list[str] = []
# LiveServerTestCase is a TransactionTestCase: it wants a database, even an unused one.
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
STATIC_URL = "/static/"  # LiveServerTestCase serves static files from it
# cache.lock(...) as django-redis spells it, on hotlock (hotlock.django.cache).
CACHES = {
    "default": {"BACKEND": "hotlock.django.cache.RedisCache", "LOCATION": os.environ["CACHE_URL"]}
    if os.environ.get("CACHE_URL")
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}
HOTLOCK = json.loads(os.environ["HOTLOCK_JSON"]) if os.environ.get("HOTLOCK_JSON") else {"TIMEOUT": 2.0}
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "ERROR"}}
