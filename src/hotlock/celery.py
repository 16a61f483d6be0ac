"""hotlock.celery: Celery tasks that hold a lock where they run, and a beat that ticks only as leader.

    cache = lambda: hotlock.connect("redis://...")          # called once in each worker process

    @hotlock.celery.locked_task(app, "charge:{invoice_id}", cache=cache, ttl=30, on_conflict="retry")
    def charge(invoice_id): ...

    celery -A proj beat -S hotlock.celery:LeaderScheduler   # on as many machines as you like

The lock is taken in the worker, around the task's body (not when the task is sent, so
``send_task`` and canvases are covered), on the key the template builds from the task's
arguments (the templates of ``Cache.locked``), and extended in the background while the
body runs. ``pip install hotlock[celery]``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from celery import Celery, Task
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from ._cache import Cache
from ._decorate import Locking
from ._validate import Seconds, ttl_ms, wait_ms
from .errors import LockNotAcquired
from .leader import Leader

__all__ = ["LeaderScheduler", "LockedTask", "locked_task"]

log = logging.getLogger("hotlock")

OnConflict = Literal["skip", "retry", "raise"]
CacheSource = Cache | Callable[[], Cache]
F = TypeVar("F", bound=Callable[..., Any])

_ON_CONFLICT = ("skip", "retry", "raise")


def _check(
    cache: object,
    lock_key: object,
    lock_ttl: Any,
    lock_wait: Any,
    on_conflict: object,
    conflict_countdown: Any,
    done_ttl: Any,
) -> None:
    """The options of a locked task, checked before anything is sent."""
    if cache is None:
        raise TypeError("a locked task needs hotlock_cache: a hotlock.Cache, or a function returning one")
    if not isinstance(cache, Cache) and not callable(cache):
        raise TypeError(
            f"hotlock_cache must be a hotlock.Cache or a function returning one, not {type(cache).__name__}"
        )
    if lock_key is not None and not isinstance(lock_key, str):
        raise TypeError(f"lock_key must be a str template or None, not {type(lock_key).__name__}")
    if on_conflict not in _ON_CONFLICT:
        raise ValueError(f"on_conflict must be one of {', '.join(map(repr, _ON_CONFLICT))}, not {on_conflict!r}")
    if lock_wait is not None:
        wait_ms(lock_wait)
    Locking(lock_key or "task", lock_ttl, lock_wait, 1, True, None)
    wait_ms(conflict_countdown)
    if done_ttl is not None:
        ttl_ms(done_ttl)


class LockedTask(Task):  # type: ignore[misc]
    """A Celery Task base class whose body runs holding a hotlock lock.

    Set the options as class attributes, or as ``app.task(base=LockedTask, ...)`` keywords:

    - ``hotlock_cache``: a hotlock.Cache, or (better under prefork) a function returning
      one, called once in each worker process.
    - ``lock_key``: a ``Cache.locked`` template on the task's parameters
      (``"charge:{invoice_id}"``); default ``celery:<task name>``, one run at a time.
    - ``lock_ttl`` (30 s): the lease, extended every ttl/3 while the body runs; a worker
      killed outright frees the key within it.
    - ``lock_wait`` (None): wait up to this many seconds for the key before a conflict.
    - ``on_conflict``: "skip" (the default: the run returns None, succeeds and uses up no
      retry), "retry" (``self.retry`` after ``conflict_countdown`` seconds, jittered; it
      counts against ``max_retries``) or "raise" (LockNotAcquired fails the task).
    - ``done_ttl`` (None): when set, a marker ``celery-done:<name>:<id>:<retries>`` is
      claimed with set_nx as the attempt starts, kept this long (make it longer than
      the broker's visibility timeout); a redelivered copy of the same attempt then
      returns None without running. The body runs at most once per attempt: a run cut
      short by a kill is not run again, so use it where twice is worse than never, as
      for a charge. A retry (``self.retry``, or ``on_conflict="retry"``) is a new attempt.
    """

    hotlock_cache: CacheSource | None = None
    lock_key: str | None = None
    lock_ttl: Seconds = 30.0
    lock_wait: Seconds | None = None
    on_conflict: OnConflict = "skip"
    conflict_countdown: Seconds = 1.0
    done_ttl: Seconds | None = None

    # Per worker process: the cache and the key builder, made on the first run there.
    _hotlock_pid = 0
    _hotlock_made: Cache | None = None
    _hotlock_key: Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None

    def _hotlock(self) -> tuple[Cache, Callable[[tuple[Any, ...], dict[str, Any]], str]]:
        pid = os.getpid()
        if self._hotlock_pid != pid or self._hotlock_made is None or self._hotlock_key is None:
            # A function stored as a class attribute would come back bound to the task.
            source: Any = inspect.getattr_static(self, "hotlock_cache")
            if isinstance(source, staticmethod):
                source = source.__func__
            _check(
                source,
                self.lock_key,
                self.lock_ttl,
                self.lock_wait,
                self.on_conflict,
                self.conflict_countdown,
                self.done_ttl,
            )
            # Without a template, one key per task name (braces escaped: a name is no template).
            name = f"celery:{self.name}".replace("{", "{{").replace("}", "}}")
            template = self.lock_key if self.lock_key is not None else name
            locking = Locking(template, self.lock_ttl, self.lock_wait, 1, True, None)
            key_of = locking.keys(self.run, coroutine=False)
            # A cache made before a prefork fork belongs to the parent: a factory makes one
            # per child.
            made = source if isinstance(source, Cache) else source()
            if not isinstance(made, Cache):
                raise TypeError(f"hotlock_cache() must return a hotlock.Cache, not {type(made).__name__}")
            if not made.enabled:
                log.warning(
                    "task %s: its cache is the in-process fallback; it excludes nothing across processes", self.name
                )
            self._hotlock_made, self._hotlock_key, self._hotlock_pid = made, key_of, pid
        assert self._hotlock_made is not None and self._hotlock_key is not None
        return self._hotlock_made, self._hotlock_key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache, key_of = self._hotlock()
        key = key_of(args, kwargs)
        request = self.request
        # Not when the task is called as a plain function: there is no delivery to repeat.
        if self.done_ttl is not None and request.id is not None and not request.called_directly:
            # Claimed before the lock: a redelivered copy that meets its still-running
            # original must end here, not retry into an attempt of its own. A retry is a
            # new attempt (request.retries + 1), with a marker of its own.
            marker = f"celery-done:{self.name}:{request.id}:{request.retries or 0}"
            if not cache.set_nx(marker, str(os.getpid()), self.done_ttl):
                log.info("task %s[%s]: this attempt ran already (a redelivery); not run again", self.name, request.id)
                return None
        try:
            if self.lock_wait is None:
                lock = cache.lock(key, self.lock_ttl, auto_extend=True)
            else:
                lock = cache.lock_wait(key, self.lock_ttl, self.lock_wait, auto_extend=True)
        except LockNotAcquired as error:
            return self._conflict(key, error)
        with lock:
            return super().__call__(*args, **kwargs)

    def _conflict(self, key: str, error: LockNotAcquired) -> Any:
        if self.on_conflict == "raise":
            raise error
        if self.on_conflict == "retry":
            countdown = wait_ms(self.conflict_countdown) / 1000 * random.uniform(0.5, 1.5)
            raise self.retry(exc=error, countdown=countdown)
        log.info("task %s[%s]: skipped, lock %r is held elsewhere", self.name, self.request.id, key)
        return None


def locked_task(
    app: Celery,
    key: str | None = None,
    *,
    cache: CacheSource,
    ttl: Seconds = 30.0,
    wait: Seconds | None = None,
    on_conflict: OnConflict = "skip",
    conflict_countdown: Seconds = 1.0,
    done_ttl: Seconds | None = None,
    **task_options: Any,
) -> Callable[[F], Task]:
    """``@app.task`` with a lock: ``@locked_task(app, "charge:{invoice_id}", cache=...)``.

    The options are LockedTask's (``key`` is ``lock_key``, ``ttl`` is ``lock_ttl``,
    ``wait`` is ``lock_wait``); ``task_options`` go to ``app.task`` (``bind``,
    ``max_retries``, ``time_limit``, ``acks_late``, ...). Checked here, before any task is
    sent: a template field that names no parameter raises ValueError.
    """
    _check(cache, key, ttl, wait, on_conflict, conflict_countdown, done_ttl)
    if "base" in task_options and not issubclass(task_options["base"], LockedTask):
        raise TypeError("base must be a subclass of hotlock.celery.LockedTask")
    task_options.setdefault("base", LockedTask)

    def decorate(fn: F) -> Task:
        if key is not None:
            # The template against the parameters, now (bind=True: the first is the task).
            Locking(key, ttl, wait, 1, True, None).keys(
                _without_self(fn) if task_options.get("bind") else fn, coroutine=False
            )
        task: Task = app.task(
            hotlock_cache=cache,
            lock_key=key,
            lock_ttl=ttl,
            lock_wait=wait,
            on_conflict=on_conflict,
            conflict_countdown=conflict_countdown,
            done_ttl=done_ttl,
            **task_options,
        )(fn)
        return task

    return decorate


def _without_self(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in with ``fn``'s signature less its first parameter (the task, under bind=True)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1:]

    @functools.wraps(fn)
    def shown(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("only its signature is read")

    shown.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return shown


class LeaderScheduler(Scheduler):  # type: ignore[misc]
    """A celery beat scheduler that sends tasks only while it leads: run a beat on each of
    several machines with ``-S hotlock.celery:LeaderScheduler``; one ticks, the others
    wait as standbys and take over within one lease TTL of the leader's end (at once when
    it stops cleanly).

    Settings (``app.conf``): ``hotlock_url`` (else CACHE_URL), ``hotlock_prefix``
    ("hotlock:"), ``hotlock_beat_name`` ("celery-beat": the beats of one name and prefix
    elect one leader), ``hotlock_beat_ttl`` (10 s).

    Each due entry is also claimed once per period (``set_nx`` on
    ``beat:<entry>:<period number>``) before it is sent, so a deposed leader that has not
    yet noticed (a process resumed after SIGSTOP) and its successor never both send one
    tick. Sent tasks carry the headers ``hotlock_epoch`` (the leader's fence) and
    ``hotlock_tick``. The schedule itself is the one in ``beat_schedule``, kept in memory.
    """

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        conf = app.conf
        url = conf.get("hotlock_url")
        name = conf.get("hotlock_beat_name") or "celery-beat"
        ttl = conf.get("hotlock_beat_ttl") or 10.0
        prefix = conf.get("hotlock_prefix") or "hotlock:"
        from . import connect

        cache = connect(url, prefix=prefix)
        if not cache.enabled:
            # The in-process fallback would make every beat its own leader.
            raise ValueError("LeaderScheduler needs a Redis: set app.conf.hotlock_url or CACHE_URL")
        self.leader = Leader(cache, name, ttl)
        super().__init__(app, *args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._leading():
            return 0.0  # campaign again at once: the campaign itself waited
        # Never sleep through a loss for long: a leader looks at its lease at least every ttl/4.
        return float(min(super().tick(*args, **kwargs), self.leader.ttl / 4))

    def _leading(self) -> bool:
        leader = self.leader
        if leader.is_leader:
            return True
        try:
            # Waits for the leader's lease to end, so a standby takes over as its TTL runs out.
            return leader.campaign(wait=leader.ttl / 2)
        except Exception as error:  # Redis down: stay a standby, never exit
            log.warning("beat %r: campaign failed: %s", leader.name, error)
            time.sleep(min(1.0, leader.ttl / 4))
            return False

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        leader = self.leader
        epoch = leader.epoch
        if epoch is None:
            log.info("beat %r: not leading; %s not sent", leader.name, entry.name)
            return
        period = _period(entry.schedule)
        tick = int(time.time() // period)
        try:
            first = leader.cache.set_nx(f"beat:{entry.name}:{tick}", str(epoch), max(2 * period, leader.ttl))
        except Exception as error:
            log.warning("beat %r: %s not sent, its tick could not be claimed: %s", leader.name, entry.name, error)
            return
        if not first or not leader.is_leader:
            log.info("beat %r: tick %d of %s was sent already", leader.name, tick, entry.name)
            return
        headers = dict(entry.options.get("headers") or {})
        headers.update(hotlock_epoch=epoch, hotlock_tick=tick)
        entry.options = {**entry.options, "headers": headers}
        super().apply_entry(entry, producer=producer)

    def close(self) -> None:
        # A clean stop hands over at once instead of after a TTL.
        try:
            super().close()
        finally:
            self.leader.step_down()
            self.leader.cache.close()


def _period(entry_schedule: object) -> float:
    """The seconds between two ticks of an entry: an interval's own; a crontab's minute."""
    if isinstance(entry_schedule, schedule) and not isinstance(entry_schedule, crontab):
        return max(float(entry_schedule.run_every.total_seconds()), 0.001)
    return 60.0
