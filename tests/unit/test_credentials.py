"""hotlock._credentials without a server: the checks connect() runs before any I/O, the
provider's answers as AUTH commands, and its failures as CacheError."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.credentials import CredentialProvider, UsernamePasswordCredentialProvider

from hotlock import CacheError
from hotlock._credentials import ask, ask_async, auth_args, check_credentials, is_auth_refusal


class Answers:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def get_credentials(self) -> Any:
        return self.answer


@pytest.mark.parametrize(
    ("username", "password", "command"),
    [
        (None, None, None),
        (None, "pw", (b"AUTH", b"pw")),
        ("app", "pw", (b"AUTH", b"app", b"pw")),
        ("app", None, (b"AUTH", b"app", b"")),  # a username alone: that user, never default
        ("app", "", (b"AUTH", b"app", b"")),
        (None, "", (b"AUTH", b"")),
    ],
)
def test_auth_args(username: str | None, password: str | None, command: tuple[bytes, ...] | None) -> None:
    assert auth_args(username, password) == command


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (("pw",), (None, "pw")),
        (("app", "pw"), ("app", "pw")),
        (["app", "pw"], ("app", "pw")),
        (("", "pw"), (None, "pw")),
    ],
)
def test_the_provider_answers_redis_py_shapes(answer: Any, expected: tuple[str | None, str | None]) -> None:
    assert ask(Answers(answer), "srv") == expected
    assert asyncio.run(ask_async(Answers(answer), "srv")) == expected


@pytest.mark.parametrize("answer", [None, "pw", (), ("a", "b", "c"), (b"app", b"pw"), {"password": "secret"}])
def test_an_answer_of_another_shape_is_a_cache_error_without_its_values(answer: Any) -> None:
    with pytest.raises(CacheError, match=r"credential_provider Answers\.get_credentials\(\) returned") as info:
        ask(Answers(answer), "srv")
    assert "secret" not in str(info.value)


def test_redis_py_providers_are_asked_their_own_way() -> None:
    plain = UsernamePasswordCredentialProvider("app", "pw")
    assert ask(plain, "srv") == ("app", "pw")
    assert asyncio.run(ask_async(plain, "srv")) == ("app", "pw")

    class SyncOnly(CredentialProvider):
        """Inherits redis-py's default get_credentials_async, which only warns: skipped."""

        def get_credentials(self) -> tuple[str]:
            return ("pw",)

    assert asyncio.run(ask_async(SyncOnly(), "srv")) == (None, "pw")


def test_a_failing_provider_is_a_cache_error_naming_it_and_chained() -> None:
    class Down:
        def get_credentials(self) -> tuple[str]:
            raise TimeoutError("token endpoint")

    with pytest.raises(CacheError, match=r"credential_provider Down\.get_credentials\(\) failed: TimeoutError") as info:
        ask(Down(), "srv")
    assert isinstance(info.value.__cause__, TimeoutError)
    assert info.value.server == "srv"


def test_check_credentials() -> None:
    provider = Answers(("pw",))
    assert check_credentials(None, None, None, None) == (None, 0.0)
    assert check_credentials(provider, None, None, None) == (provider, 0.0)
    assert check_credentials(provider, 30, None, None) == (provider, 30.0)
    with pytest.raises(TypeError, match="get_credentials"):
        check_credentials(object(), None, None, None)
    with pytest.raises(ValueError, match="not both"):
        check_credentials(provider, None, "u", None)
    with pytest.raises(ValueError, match="needs a credential_provider"):
        check_credentials(None, 30, "u", "p")
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="reauth_interval"):
            check_credentials(provider, bad, None, None)
    for wrong in ("30", True, [30]):
        with pytest.raises(TypeError, match="reauth_interval"):
            check_credentials(provider, wrong, None, None)


def test_which_replies_are_auth_refusals() -> None:
    assert is_auth_refusal("NOAUTH Authentication required.")
    assert is_auth_refusal("WRONGPASS invalid username-password pair or user is disabled.")
    assert not is_auth_refusal("NOPERM this user has no permissions")
    assert not is_auth_refusal("ERR invalid password")
