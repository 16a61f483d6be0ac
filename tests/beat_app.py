"""The Celery app of the beats in tests/test_leader.py (``celery -A tests.beat_app beat``).

From the environment: HOTLOCK_TEST_BROKER (the broker the beats send to; no worker reads
it, the test does), HOTLOCK_TEST_LOCKS (the Redis of the leader lease), HOTLOCK_TEST_PREFIX, HOTLOCK_TEST_TTL
(the lease, s; 2 by default).
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("hotlock_beat_test", broker=os.environ.get("HOTLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"))
app.conf.update(
    hotlock_url=os.environ.get("HOTLOCK_TEST_LOCKS"),
    hotlock_prefix=os.environ.get("HOTLOCK_TEST_PREFIX", "hotlock:"),
    hotlock_beat_name="test-beat",
    hotlock_beat_ttl=float(os.environ.get("HOTLOCK_TEST_TTL", "2")),
    beat_schedule={"tick": {"task": "tests.beat_app.tick", "schedule": 0.5}},
    broker_connection_retry_on_startup=True,
)


@app.task
def tick() -> None:
    pass
