"""Route, the cluster's redirection rules for one call, driven by scripted replies: no
server, no socket. Each test plays the caller's part (send ``batches()``, hand back each
node's replies or the exception that lost them, ``advance()``) and checks what Route
decides: where each key goes, what is resent, when to pause, when the call has failed."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

import hotlock.backends.cluster
from hotlock._acquire import commands as transaction
from hotlock._acquire import read as read_transaction
from hotlock._acquire import refused_multi
from hotlock._config import parse_url
from hotlock._dialect import detect
from hotlock._exchange import LOADS
from hotlock._scripts import ACQUIRE, ACQUIRE_POLL, ACQUIRE_WAIT, EXTEND, SCRIPTS, held_value
from hotlock.backends.cluster import ClusterCore, Route, key_slot, transaction_form
from hotlock.errors import CacheError, LinkLost, ReplyError, Unreplicated

from .conftest import FakeClock, patch_clock

A, B, C = ("10.0.0.1", 7000), ("10.0.0.2", 7000), ("10.0.0.3", 7000)
TOKEN = b"t" * 16
Batches = dict[tuple[str, int], list[tuple[bytes, ...]]]  # what each node is sent


def core(wait_replicas: int = 0) -> ClusterCore:
    config = parse_url(
        "redis+cluster://10.0.0.1:7000",
        connect_timeout=1.0,
        timeout=0.5,
        wait_replicas=wait_replicas,
        wait_timeout=0.1,
    )
    cluster = ClusterCore(config, "cluster")
    cluster.map.replace([(0, 5460, A), (5461, 10922, B), (10923, 16383, C)])
    return cluster


def key_on(address: tuple[str, int], n: int = 0) -> bytes:
    """The n-th key of the form k<i> whose slot ``address`` serves in core()'s map."""
    first, last = {A: (0, 5460), B: (5461, 10922), C: (10923, 16383)}[address]
    found = (k for k in (b"k%d" % i for i in itertools.count()) if first <= key_slot(k) <= last)
    return next(itertools.islice(found, n, None))


def acquire(cluster: ClusterCore, keys: list[bytes], retry_until: float | None = 1e18) -> Route:
    return cluster.route("acquire_many", ACQUIRE, keys, [(TOKEN, b"30000")] * len(keys), retry_until)


def sent(route: Route) -> Batches:
    return dict(route.batches())


def answer(route: Route, batches: Batches, replies: dict[Any, Any]) -> None:
    for address in batches:
        outcome = replies[address]
        if isinstance(outcome, BaseException):
            route.lost(address, outcome)
        else:
            route.replies(address, list(outcome))


def test_a_batch_goes_to_each_keys_primary_and_comes_back_in_the_callers_order() -> None:
    keys = [key_on(C), key_on(A), key_on(B), key_on(A, 1)]
    route = acquire(core(), keys)
    batches = sent(route)
    assert {a: [c[3] for c in cmds] for a, cmds in batches.items()} == {
        C: [keys[0]],
        A: [keys[1], keys[3]],
        B: [keys[2]],
    }
    answer(route, batches, {A: [11, 13], B: [12], C: [10]})
    assert route.advance() is None
    assert route.results == [10, 11, 12, 13]


def test_moved_notes_the_new_owner_and_resends_only_that_key_there() -> None:
    cluster = core()
    keys = [key_on(A), key_on(B)]
    route = acquire(cluster, keys)
    slot = key_slot(keys[0])
    answer(route, sent(route), {A: [ReplyError(f"MOVED {slot} 10.0.0.3:7000")], B: [5]})
    assert route.advance() == 0.0  # no pause: the new owner is known
    assert cluster.map.owner(slot) == C and cluster.map.stale
    again = sent(route)
    assert list(again) == [C] and again[C][0][3] == keys[0]
    answer(route, again, {C: [6]})
    assert route.advance() is None and route.results == [6, 5]


def test_moved_with_an_empty_host_means_the_node_that_answered() -> None:
    cluster = core()
    key = key_on(A)
    route = acquire(cluster, [key])
    answer(route, sent(route), {A: [ReplyError(f"MOVED {key_slot(key)} :7001")]})
    route.advance()
    assert list(sent(route)) == [("10.0.0.1", 7001)]


def test_ask_sends_asking_first_once_and_leaves_the_map_alone() -> None:
    cluster = core()
    key = key_on(A)
    route = acquire(cluster, [key])
    answer(route, sent(route), {A: [ReplyError(f"ASK {key_slot(key)} 10.0.0.2:7000")]})
    assert route.advance() == 0.0
    again = sent(route)
    assert again[B][0] == (b"ASKING",) and again[B][1][3] == key
    assert cluster.map.owner(key_slot(key)) == A  # the slot is still A's until the migration ends
    answer(route, again, {B: [b"OK", 7]})
    assert route.advance() is None and route.results == [7]


def test_an_ask_answered_with_ask_fails_instead_of_looping() -> None:
    key = key_on(A)
    route = acquire(core(), [key])
    answer(route, sent(route), {A: [ReplyError(f"ASK {key_slot(key)} 10.0.0.2:7000")]})
    route.advance()
    answer(route, sent(route), {B: [b"OK", ReplyError(f"ASK {key_slot(key)} 10.0.0.3:7000")]})
    with pytest.raises(CacheError, match="after ASKING"):
        route.advance()


def test_redirects_are_bounded() -> None:
    key = key_on(A)
    route = acquire(core(), [key])
    with pytest.raises(CacheError, match="redirected"):
        for hop in itertools.count():
            batches = sent(route)
            (address,) = batches
            target = (A, B)[hop % 2]
            answer(route, batches, {address: [ReplyError(f"MOVED {key_slot(key)} {target[0]}:{target[1]}")]})
            route.advance()
            assert hop < 50


@pytest.mark.parametrize("reply", ["TRYAGAIN", "CLUSTERDOWN", "BUSY", "LOADING", "MASTERDOWN", "READONLY"])
def test_a_transient_reply_pauses_within_the_budget_then_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, reply: str
) -> None:
    patch_clock(monkeypatch, hotlock.backends.cluster, clock)
    key = key_on(A)
    route = acquire(core(), [key], retry_until=None)  # the budget: one reply timeout (0.5 s)
    start, pauses = clock.now, []
    with pytest.raises(
        CacheError, match=rf"retried \d+ times within the call's timeout\) failed: the server replied {reply}"
    ):
        while len(pauses) < 1000:
            answer(route, sent(route), {A: [ReplyError(f"{reply} something")]})
            pause = route.advance()
            assert pause is not None
            pauses.append(pause)
            clock.sleep(pause)
    # hotlock._transient's schedule: each pause in the upper half of a ceiling doubling
    # from 5 ms to 100 ms, the last one cut to what was left.
    for n, pause in enumerate(pauses[:-1]):
        ceiling = min(0.1, 0.005 * 2**n)
        assert ceiling / 2 <= pause <= ceiling, (n, pause)
    # It gives up rather than sleep past the budget: never later than the reply timeout.
    assert clock.now - start <= 0.5 + 1e-9
    assert clock.now - start >= 0.5 - 0.001


@pytest.mark.parametrize("reply", ["CLUSTERDOWN", "READONLY", "MASTERDOWN"])
def test_an_election_or_a_demoted_primary_pauses_and_marks_the_map_stale(reply: str) -> None:
    cluster = core()
    key = key_on(B)
    route = acquire(cluster, [key])
    answer(route, sent(route), {B: [ReplyError(f"{reply} The cluster is down")]})
    pause = route.advance()
    assert pause is not None and 0.0025 <= pause <= 0.005
    assert cluster.map.stale
    answer(route, sent(route), {B: [3]})
    assert route.advance() is None and route.results == [3]


@pytest.mark.parametrize("reply", ["TRYAGAIN", "BUSY", "LOADING"])
def test_a_transient_reply_resends_only_what_did_not_run(reply: str) -> None:
    keys = [key_on(A), key_on(A, 1)]
    route = acquire(core(), keys)
    answer(route, sent(route), {A: [7, ReplyError(f"{reply} wait")]})
    assert route.advance() is not None
    again = sent(route)
    assert [c[3] for c in again[A]] == [keys[1]]  # the same command, same token
    answer(route, again, {A: [8]})
    assert route.advance() is None and route.results == [7, 8]


def test_noscript_asks_for_a_reload_there_and_resends_once() -> None:
    key = key_on(C)
    route = acquire(core(), [key])
    answer(route, sent(route), {C: [ReplyError("NOSCRIPT No matching script.")]})
    assert route.advance() == 0.0
    # Every script loaded there, in the same write as the call that did not run.
    batches = sent(route)
    assert batches[C][: len(LOADS)] == LOADS and batches[C][len(LOADS) :] == [route.commands[0]]
    loaded = [s.sha for s in SCRIPTS]
    answer(route, batches, {C: [*loaded, ReplyError("NOSCRIPT No matching script.")]})
    with pytest.raises(CacheError, match="NOSCRIPT"):
        route.advance()  # loaded once already in this call: not a loop


def test_a_refused_reload_is_the_calls_error_and_a_lost_one_goes_again() -> None:
    key = key_on(C)
    route = acquire(core(), [key])
    answer(route, sent(route), {C: [ReplyError("NOSCRIPT No matching script.")]})
    route.advance()
    answer(route, sent(route), {C: LinkLost("timeout")})
    assert route.advance() == 0.0
    assert sent(route)[C][: len(LOADS)] == LOADS  # the loads' replies were lost with the rest
    route = acquire(core(), [key])
    answer(route, sent(route), {C: [ReplyError("NOSCRIPT No matching script.")]})
    route.advance()
    refused = ReplyError("NOPERM this user has no permissions to run the 'script|load' command")
    answer(route, sent(route), {C: [refused] * len(LOADS) + [7]})
    with pytest.raises(CacheError, match="SCRIPT LOAD: the server replied NOPERM"):
        route.advance()


@pytest.mark.parametrize("refusal", ["NOAUTH Authentication required.", "WRONGPASS invalid username-password pair"])
def test_an_auth_refusal_asks_for_a_new_connection_there_and_resends_once(refusal: str) -> None:
    """NOAUTH/WRONGPASS: nothing ran; the caller drops that node's connection (the new one
    asks the credential provider again) and the command goes once more, even one never
    resent after a lost reply (no retry budget); a second refusal is the call's error."""
    key = key_on(C)
    route = acquire(core(), [key], retry_until=None)
    answer(route, sent(route), {C: [ReplyError(refusal)]})
    assert route.advance() == 0.0
    assert route.reconnect == {C}
    route.reconnect.clear()
    answer(route, sent(route), {C: [7]})
    assert route.advance() is None and route.results == [7]
    route = acquire(core(), [key])
    answer(route, sent(route), {C: [ReplyError(refusal)]})
    route.advance()
    answer(route, sent(route), {C: [ReplyError(refusal)]})
    with pytest.raises(CacheError, match=refusal.split()[0]):
        route.advance()


def test_a_lost_reply_is_resent_once_with_the_same_token_and_a_map_refresh() -> None:
    cluster = core()
    key = key_on(A)
    route = acquire(cluster, [key])
    first = sent(route)
    answer(route, first, {A: LinkLost("timed out")})
    assert route.advance() == 0.0
    assert route.refresh_avoiding == A and route.override is not None and cluster.map.stale
    again = sent(route)
    assert again == first  # the very same command: same token, so the script counts it held
    answer(route, again, {A: LinkLost("timed out")})
    with pytest.raises(CacheError, match=r"retried after a lost reply\) failed on 10\.0\.0\.1:7000"):
        route.advance()


def test_a_lost_reply_without_a_retry_budget_fails_at_once() -> None:
    route = core().route("extend", EXTEND, [key_on(A)], [(TOKEN, b"30000")], None)
    answer(route, sent(route), {A: LinkLost("reset")})
    with pytest.raises(CacheError, match=r"extend failed on 10\.0\.0\.1:7000: reset") as info:
        route.advance()
    assert "retried" not in str(info.value)


def test_a_node_that_could_not_be_reached_is_resent_without_spending_the_retry() -> None:
    key = key_on(B)
    route = core().route("extend", EXTEND, [key], [(TOKEN, b"30000")], None)
    answer(route, sent(route), {B: CacheError("connection refused")})
    assert route.advance() == 0.0 and route.refresh_avoiding == B
    answer(route, sent(route), {B: [1]})  # nothing ran the first time: even an extend may go again
    assert route.advance() is None and route.results == [1]


def test_a_reply_that_may_mean_the_command_ran_is_not_resent() -> None:
    route = acquire(core(), [key_on(A)])
    answer(route, sent(route), {A: [ReplyError("BUSYKEY Target key name already exists.")]})
    with pytest.raises(CacheError, match="BUSYKEY") as info:
        route.advance()
    assert "retried" not in str(info.value)


def test_a_slot_without_a_primary_is_a_cache_error_not_a_guess() -> None:
    cluster = core()
    cluster.map.replace([(0, 5460, A), (10923, 16383, C)])
    key = key_on(B)
    route = acquire(cluster, [key])
    assert route.unserved() == key
    with pytest.raises(CacheError, match="no primary serves the slot"):
        route.batches()


def test_wait_replicas_appends_wait_per_node_and_fails_short_confirmations() -> None:
    cluster = core(wait_replicas=1)
    keys = [key_on(A), key_on(B)]
    route = acquire(cluster, keys)
    batches = sent(route)
    assert all(cmds[-1] == (b"WAIT", b"1", b"100") for cmds in batches.values())
    answer(route, batches, {A: [4, 1], B: [5, 0]})
    with pytest.raises(CacheError, match=r"0 of 1 replicas of 10\.0\.0\.2:7000 confirmed it within 100 ms"):
        route.advance()
    # What the caller undoes: both acquired keys, with the values the script stored.
    assert route.acquired_values() == (keys, [held_value(TOKEN, 4), held_value(TOKEN, 5)])


def test_wait_replicas_confirms_extends_per_node() -> None:
    """Extends: one WAIT per node behind them; a node's shortfall loses the extends that
    ran there (Unreplicated, with the values to release), the other node's stand, and an
    extend that found the key gone needs no confirmation."""
    cluster = core(wait_replicas=1)
    keys = [key_on(A), key_on(B), key_on(B, 1)]
    values = [b"a" * 20, b"b" * 20, b"c" * 20]
    route = cluster.route("extend_many", EXTEND, keys, [(v, b"30000") for v in values], None)
    batches = sent(route)
    assert {a: [c[0] for c in cmds] for a, cmds in batches.items()} == {
        A: [b"EVALSHA", b"WAIT"],
        B: [b"EVALSHA", b"EVALSHA", b"WAIT"],
    }
    answer(route, batches, {A: [1, 1], B: [1, 0, 0]})
    with pytest.raises(Unreplicated) as info:
        route.advance()
    assert info.value.results == [True, False, False]
    assert info.value.why == {
        1: "is lost: extend_many undone: 0 of 1 replicas of 10.0.0.2:7000 confirmed it within 100 ms (wait_replicas)"
    }
    assert route.unconfirmed_values() == ([keys[1]], [values[1]])
    # Every node confirmed: the results stand.
    route = cluster.route("extend_many", EXTEND, keys, [(v, b"30000") for v in values], None)
    answer(route, sent(route), {A: [1, 1], B: [1, 1, 1]})
    assert route.advance() is None and route.results == [1, 1, 1]


def test_without_wait_replicas_extends_send_no_wait() -> None:
    route = core().route("extend", EXTEND, [key_on(A)], [(b"a" * 20, b"30000")], None)
    assert [c[0] for c in sent(route)[A]] == [b"EVALSHA"]


def test_only_acquired_keys_are_undone() -> None:
    keys = [key_on(A), key_on(B)]
    route = acquire(core(), keys)
    answer(route, sent(route), {A: [9], B: [-250]})  # B: held elsewhere (minus its TTL left)
    assert route.advance() is None
    assert route.acquired_values() == ([keys[0]], [held_value(TOKEN, 9)])


# -- the transaction acquire (hotlock._acquire) -----------------------------------------

QUEUED = b"QUEUED"
CLOCK = [b"1700000000", b"000005"]
FENCE = 1_700_000_000_000_005


def transacting(wait_replicas: int = 0, scripts: str = "auto") -> ClusterCore:
    """core() after connect() chose ``scripts`` (the acquire goes as the transaction under "auto")."""
    cluster = core(wait_replicas)
    cluster.use_dialect(detect(None, None, scripts))
    return cluster


def test_an_acquire_goes_as_the_transaction_to_the_keys_node() -> None:
    keys = [key_on(A), key_on(B)]
    route = acquire(transacting(), keys)
    batches = sent(route)
    assert batches == {A: list(transaction(keys[0], TOKEN, 30000)), B: list(transaction(keys[1], TOKEN, 30000))}
    taken = [b"OK", QUEUED, QUEUED, [b"OK", CLOCK]]
    answer(route, batches, {A: taken, B: taken})
    assert route.advance() is None and route.results == [FENCE, FENCE]


def test_a_key_that_exists_goes_on_to_the_script_on_the_same_node() -> None:
    keys = [key_on(A), key_on(A, 1)]
    route = acquire(transacting(), keys)
    answer(route, sent(route), {A: [b"OK", QUEUED, QUEUED, [None, CLOCK], b"OK", QUEUED, QUEUED, [b"OK", CLOCK]]})
    assert route.advance() == 0.0
    again = sent(route)
    assert again == {A: [(b"EVALSHA", ACQUIRE.sha, b"1", keys[0], TOKEN, b"30000")]}
    answer(route, again, {A: [-2500]})
    assert route.advance() is None and route.results == [-2500, FENCE]


def test_moved_on_the_queued_set_resends_the_transaction_to_the_new_owner() -> None:
    cluster = transacting()
    key = key_on(A)
    slot = key_slot(key)
    route = acquire(cluster, [key])
    moved = ReplyError(f"MOVED {slot} 10.0.0.3:7000")
    aborted = ReplyError("EXECABORT Transaction discarded because of previous errors.")
    answer(route, sent(route), {A: [b"OK", moved, QUEUED, aborted]})
    assert route.advance() == 0.0
    assert cluster.map.owner(slot) == C and cluster.map.stale
    again = sent(route)
    assert again == {C: list(transaction(key, TOKEN, 30000))}
    answer(route, again, {C: [b"OK", QUEUED, QUEUED, [b"OK", CLOCK]]})
    assert route.advance() is None and route.results == [FENCE]


def test_ask_on_the_queued_set_sends_asking_and_the_script() -> None:
    cluster = transacting()
    key = key_on(A)
    route = acquire(cluster, [key])
    asked = ReplyError(f"ASK {key_slot(key)} 10.0.0.2:7000")
    aborted = ReplyError("EXECABORT Transaction discarded because of previous errors.")
    answer(route, sent(route), {A: [b"OK", asked, QUEUED, aborted]})
    assert route.advance() == 0.0
    again = sent(route)
    assert again == {B: [(b"ASKING",), (b"EVALSHA", ACQUIRE.sha, b"1", key, TOKEN, b"30000")]}
    assert cluster.map.owner(key_slot(key)) == A
    answer(route, again, {B: [b"OK", FENCE]})
    assert route.advance() is None and route.results == [FENCE]


def test_a_transient_reply_in_the_transaction_is_waited_out_and_resent_as_one() -> None:
    key = key_on(A)
    route = acquire(transacting(), [key])
    down = ReplyError("CLUSTERDOWN The cluster is down")
    answer(route, sent(route), {A: [down, down, down, down]})
    assert (route.advance() or 0) > 0
    again = sent(route)
    assert again == {A: list(transaction(key, TOKEN, 30000))}


def test_a_node_that_refuses_multi_keeps_its_acquires_on_the_script(caplog: pytest.LogCaptureFixture) -> None:
    cluster = transacting()
    keys = [key_on(A), key_on(B)]
    route = acquire(cluster, keys)
    refused = ReplyError("NOPERM User u has no permissions to run the 'multi' command")
    alone = ReplyError("NOPERM User u has no permissions to run the 'exec' command")
    answer(
        route,
        sent(route),
        {A: [refused, b"OK", CLOCK, alone], B: [b"OK", QUEUED, QUEUED, [b"OK", CLOCK]]},
    )
    assert route.advance() == 0.0
    again = sent(route)
    assert again == {A: [(b"EVALSHA", ACQUIRE.sha, b"1", keys[0], TOKEN, b"30000")]}
    answer(route, again, {A: [FENCE + 1]})
    assert route.advance() is None and route.results == [FENCE + 1, FENCE]
    later = sent(acquire(cluster, keys))
    assert later[A] == [(b"EVALSHA", ACQUIRE.sha, b"1", keys[0], TOKEN, b"30000")]
    assert later[B] == list(transaction(keys[1], TOKEN, 30000))
    assert [r.getMessage() for r in caplog.records if "refused MULTI" in r.getMessage()] == [
        f"10.0.0.1:7000 refused MULTI ({refused}): its acquires go by the ACQUIRE script from now on"
    ]


@pytest.mark.parametrize("scripts", ["auto", "always"])
def test_permits_the_waiting_forms_and_scripts_always_go_by_script(scripts: str) -> None:
    cluster = transacting(scripts=scripts)
    key = key_on(A)
    ask = TOKEN + b"#3"
    permit = cluster.route("acquire", ACQUIRE, [key], [(ask, b"30000")], 1e18)
    assert sent(permit) == {A: [(b"EVALSHA", ACQUIRE.sha, b"1", key, ask, b"30000")]}
    waiting = cluster.route("acquire", ACQUIRE_WAIT, [key], [(TOKEN, b"30000")], 1e18)
    assert sent(waiting)[A][0][1] == ACQUIRE_WAIT.sha
    plain = sent(acquire(cluster, [key]))[A]
    assert plain[0] == ((b"MULTI",) if scripts == "auto" else (b"EVALSHA", ACQUIRE.sha, b"1", key, TOKEN, b"30000"))


def test_a_lost_transaction_reply_is_resent_as_the_transaction_with_the_same_token() -> None:
    key = key_on(A)
    route = acquire(transacting(), [key])
    answer(route, sent(route), {A: LinkLost("timed out")})
    route.advance()
    again = sent(route)
    assert again == {A: list(transaction(key, TOKEN, 30000))}
    # The first one ran: SET NX finds the key, the script finds its own token.
    answer(route, again, {A: [b"OK", QUEUED, QUEUED, [None, CLOCK]]})
    route.advance()
    answer(route, sent(route), {A: [FENCE + 7]})
    assert route.advance() is None and route.results == [FENCE + 7]


def test_wait_rides_behind_the_transactions() -> None:
    key = key_on(A)
    route = acquire(transacting(wait_replicas=1), [key])
    batches = sent(route)
    assert batches[A] == [*transaction(key, TOKEN, 30000), (b"WAIT", b"1", b"100")]
    answer(route, batches, {A: [b"OK", QUEUED, QUEUED, [b"OK", CLOCK], 1]})
    assert route.advance() is None and route.results == [FENCE]


def test_a_round_handed_over_names_a_transaction_by_its_form() -> None:
    """The extension's fast path sent the transaction; Route reads its four replies and
    goes on (here: MOVED on the SET) exactly as after its own round."""
    cluster = transacting()
    keys = [key_on(A), key_on(B)]
    slot = key_slot(keys[0])
    commands = [transaction_form(keys[0], TOKEN, b"30000"), (b"EVALSHA", ACQUIRE.sha, b"1", keys[1], TOKEN, b"30000")]
    route = Route(cluster, "acquire_many", keys, commands, 1e18, False)
    assert route.commands[0] == (b"EVALSHA", ACQUIRE.sha, b"1", keys[0], TOKEN, b"30000")
    moved = ReplyError(f"MOVED {slot} 10.0.0.3:7000")
    aborted = ReplyError("EXECABORT Transaction discarded because of previous errors.")
    route.handed(({A: [0], B: [1]}, [(A, [b"OK", moved, QUEUED, aborted]), (B, [FENCE])]))
    assert route.advance() == 0.0
    assert sent(route) == {C: list(transaction(keys[0], TOKEN, 30000))}


RESP = {
    "ok": b"+OK\r\n",
    "queued": b"+QUEUED\r\n",
    "taken": b"*2\r\n+OK\r\n*2\r\n$10\r\n1700000000\r\n$6\r\n000005\r\n",
    "exists": b"*2\r\n$-1\r\n*2\r\n$10\r\n1700000000\r\n$6\r\n000005\r\n",
    "time": b"*2\r\n$10\r\n1700000000\r\n$6\r\n000005\r\n",
    "noperm": b"-NOPERM no multi\r\n",
    "moved": b"-MOVED 3999 10.0.0.3:7000\r\n",
    "abort": b"-EXECABORT Transaction discarded\r\n",
    "oddclock": b"*2\r\n+OK\r\n*2\r\n$3\r\nabc\r\n$1\r\n5\r\n",
}


@pytest.mark.parametrize(
    "replies",
    [
        ["ok", "queued", "queued", "taken"],
        ["ok", "queued", "queued", "exists"],
        ["noperm", "ok", "time", "abort"],
        ["ok", "moved", "queued", "abort"],
        ["noperm", "noperm", "noperm", "noperm"],
        ["ok", "queued", "queued", "oddclock"],
    ],
)
def test_the_extension_reads_the_transaction_as_read_does(replies: list[str]) -> None:
    native = pytest.importorskip("hotlock._native")
    raw = [RESP[r] for r in replies]
    parsed = [ReplyError(r.decode()[1:-2]) if r.startswith(b"-") else decoded(r) for r in raw]
    expected = read_transaction(parsed, ReplyError)
    got = native._read_acquire(b"".join(raw))
    if isinstance(expected, BaseException):
        assert got == str(expected)
    elif refused_multi(parsed, ReplyError):
        assert got == -1
    else:
        assert got == expected


def decoded(resp: bytes) -> Any:
    """The reply ``resp`` as Python values (the shapes RESP above uses)."""
    return {
        RESP["ok"]: b"OK",
        RESP["queued"]: b"QUEUED",
        RESP["taken"]: [b"OK", CLOCK],
        RESP["exists"]: [None, CLOCK],
        RESP["time"]: CLOCK,
        RESP["oddclock"]: [b"OK", [b"abc", b"5"]],
    }[resp]


def test_an_auth_refusal_at_multi_is_the_connections_not_a_node_without_transactions() -> None:
    cluster = transacting()
    key = key_on(A)
    route = acquire(cluster, [key])
    refused = ReplyError("NOAUTH Authentication required.")
    answer(route, sent(route), {A: [refused, b"OK", CLOCK, ReplyError("ERR EXEC without MULTI")]})
    assert route.advance() == 0.0
    assert route.reconnect == {A}
    route.reconnect.clear()
    assert sent(route) == {A: list(transaction(key, TOKEN, 30000))}  # still the transaction
    assert cluster.transacts(A, (b"EVALSHA", ACQUIRE.sha, b"1", key, TOKEN, b"30000"))


def test_a_poll_goes_by_script_even_where_the_node_takes_the_transaction() -> None:
    cluster = transacting()
    key = key_on(A)
    route = cluster.route("acquire", ACQUIRE_POLL, [key], [(TOKEN, b"30000")], 1e18)
    assert sent(route) == {A: [(b"EVALSHA", ACQUIRE.sha, b"1", key, TOKEN, b"30000")]}
    moved = ReplyError(f"MOVED {key_slot(key)} 10.0.0.3:7000")
    answer(route, {A: []}, {A: [moved]})
    route.advance()
    assert sent(route) == {C: [(b"EVALSHA", ACQUIRE.sha, b"1", key, TOKEN, b"30000")]}  # after MOVED too
