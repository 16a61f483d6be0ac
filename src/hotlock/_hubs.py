"""The wake-up subscribers' bookkeeping that the sync and async drivers share, with no I/O.

hotlock.backends.wakeup drives a subscriber from a thread, hotlock.backends.wakeup_async
from a task; what they hold and decide alike is here: ``Hub``, one subscriber's state (the
protocol's core, hotlock._subscriber.Subscriber, and why wake-ups went off); ``PerNode``, a
Redis Cluster's subscribers, one per primary; ``Made``, a backend's subscriber, made on the
first wait that needs it and made anew in a forked child.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._sentinel import PrimaryWatch
from ._subscriber import Entry, Sleeper, Subscriber

if TYPE_CHECKING:  # annotations only: importing _config at run time would raise this module's floor
    from ._config import ServerConfig

__all__ = ["Hub", "Made", "PerNode", "current_pid"]

W = TypeVar("W", bound=Sleeper)  # a waiter: a thread's (wakeup.Waiter) or a task's (wakeup_async.AsyncWaiter)
H = TypeVar("H", bound="Hub[Any]")
Address = tuple[str, int]

_pid = os.getpid()  # this process's, kept at fork: Made.get runs on every contended wait


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def current_pid() -> int:
    """This process's pid, kept at fork (cheaper than os.getpid() on every contended wait)."""
    return _pid


class Hub(Generic[W]):
    """One subscriber's state, sync or async: its protocol (``_core``), whether it is closed,
    and under Sentinel the primary it follows; ``off`` tells why wake-ups stopped, if they
    did. The driver adds the connection and ``join``."""

    def __init__(self, config: ServerConfig, sharded: bool = False) -> None:
        self.pid = os.getpid()
        self.off: str | None = None
        self._config = config
        self._server = config.display
        self._core: Subscriber[W] = Subscriber(self._server, sharded)
        self._closed = False
        # Under Sentinel: the primary to connect to, and the epoch the connection is of (a
        # failover makes the subscriber reconnect, to the new primary, as the lock connections do).
        self._watch = PrimaryWatch(config.primary) if config.sentinels else None
        self._epoch = 0

    def subscribed(self, channel: bytes) -> Entry[W] | None:
        """The channel's entry when its subscription is confirmed (a waiter may mark at once)."""
        return self._core.subscribed(channel)  # no lock: one dict lookup

    def join(self, channel: bytes) -> W | None:
        """A waiter on ``channel`` (see the drivers), or None when the caller is to poll."""
        raise NotImplementedError

    def _stopped(self) -> bool:
        """After the core was fed: whether the server turned wake-ups off (an ACL refusing
        SUBSCRIBE), said in ``off``; the subscriber then stops for good."""
        self.off = self._core.off
        return self.off is not None


class PerNode(Generic[H, W]):
    """A Redis Cluster's subscribers: one sharded-pub/sub subscriber per primary
    (``make(address)``), made when a wait first needs it, each channel joined at its slot's
    owner (``owner(channel)``, the cluster backend's slot map). A slot that moves
    unsubscribes its channel on the old node; its waiters then poll, and the next wait on
    it joins the new owner."""

    def __init__(self, owner: Callable[[bytes], Address | None], make: Callable[[Address], H]) -> None:
        # No connection of its own: only the per-node ones.
        self.pid = os.getpid()
        self.off: str | None = None
        self._owner = owner
        self._make = make
        self._nodes: dict[Address, H] = {}
        self._nodes_lock = threading.Lock()  # the sync waiters' threads (never held across an await)
        self._closed = False  # then no node's subscriber is made any more: a waiter polls

    def subscribed(self, channel: bytes) -> Entry[W] | None:
        address = self._owner(channel)
        hub = None if address is None else self._nodes.get(address)
        entry: Entry[W] | None = None if hub is None else hub.subscribed(channel)
        return entry

    def join(self, channel: bytes) -> W | None:
        address = self._owner(channel)
        if address is None:
            return None  # no primary for the slot right now: poll
        hub = self._nodes.get(address)
        if hub is None or hub._closed:
            with self._nodes_lock:
                if self._closed:
                    return None  # a wait that raced close(): it polls
                hub = self._nodes.get(address)
                if hub is None or hub._closed:
                    hub = self._nodes[address] = self._make(address)
        if hub.off is not None:
            self.off = hub.off
            return None
        waiter: W | None = hub.join(channel)
        return waiter

    def _closing(self) -> list[H]:
        """close()'s first step: no node's subscriber is made from now on. The ones to close."""
        with self._nodes_lock:
            self._closed = True
            return list(self._nodes.values())


class Made(Generic[H]):
    """A backend's subscriber: made on the first wait that needs it (``make``), and made
    anew in a forked child, which never uses or closes its parent's."""

    __slots__ = ("_hub", "_make")

    def __init__(self, make: Callable[[], H]) -> None:
        self._make = make
        self._hub: H | None = None

    def get(self) -> H | None:
        """The live subscriber, made now if need be; None when wake-ups are off."""
        hub = self._hub
        if hub is None or hub.pid != _pid:
            hub = self._made()
        return hub if hub.off is None else None

    def _made(self) -> H:
        """A new subscriber, kept: this process has none yet."""
        hub = self._hub = self._make()
        return hub

    def _taken(self) -> H | None:
        """close()'s first step: the subscriber let go, and returned (to close) when this
        process made it."""
        hub, self._hub = self._hub, None
        return hub if hub is not None and hub.pid == os.getpid() else None
