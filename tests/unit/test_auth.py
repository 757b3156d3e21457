"""Password hashing, verification, the user table and its verification cache."""

from __future__ import annotations

import base64
import hashlib

import pytest

from amqbroker.core import auth
from amqbroker.core.auth import (
    HASH_FORMAT,
    Authenticator,
    check_hash_format,
    hash_password,
    verify_password,
)

FAST = 1_000  # iterations for tests that do not care about cost
SALT = b"0123456789abcdef"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


GOOD_DIGEST = b64(bytes(32))
GOOD_SALT = b64(SALT)


@pytest.fixture
def derive_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts PBKDF2 computations (one entry per call, holding the iteration count)."""
    calls: list[int] = []
    real = auth._derive

    def counting(password: str, salt: bytes, iterations: int, dklen: int = 32) -> bytes:
        calls.append(iterations)
        return real(password, salt, iterations, dklen)

    monkeypatch.setattr(auth, "_derive", counting)
    return calls


# --- hash_password / verify_password -----------------------------------------------------


def test_round_trip_with_default_iterations() -> None:
    stored = hash_password("correct horse")
    scheme, iterations, salt, digest = stored.split("$")
    assert scheme == "pbkdf2-sha256"
    assert iterations == "200000"
    assert len(base64.b64decode(salt)) == 16
    assert len(base64.b64decode(digest)) == 32
    check_hash_format(stored)
    assert verify_password(stored, "correct horse")
    assert not verify_password(stored, "correct horse ")


def test_wrong_password() -> None:
    stored = hash_password("secret", iterations=FAST)
    assert not verify_password(stored, "Secret")
    assert not verify_password(stored, "")


def test_random_salt_and_fixed_salt() -> None:
    assert hash_password("x", iterations=FAST) != hash_password("x", iterations=FAST)
    fixed = hash_password("x", iterations=FAST, salt=SALT)
    assert fixed == hash_password("x", iterations=FAST, salt=SALT)
    assert fixed.split("$")[2] == GOOD_SALT


def test_unicode_password() -> None:
    stored = hash_password("pässwörd ✓", iterations=FAST)
    assert verify_password(stored, "pässwörd ✓")
    assert not verify_password(stored, "passwort")


def test_known_vector() -> None:
    # Computed independently of the module under test.
    expected = hashlib.pbkdf2_hmac("sha256", b"password", SALT, 1000)
    stored = f"pbkdf2-sha256$1000${GOOD_SALT}${b64(expected)}"
    assert hash_password("password", iterations=1000, salt=SALT) == stored
    assert verify_password(stored, "password")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"iterations": 0}, "iterations"),
        ({"iterations": 10**9}, "iterations"),
        ({"salt": b"short"}, "salt"),
    ],
)
def test_hash_password_rejects_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hash_password("x", **kwargs)  # type: ignore[arg-type]


MALFORMED: list[tuple[str, str]] = [
    ("", "4 fields"),
    ("plaintext-password", "4 fields"),
    (f"pbkdf2-sha256$1000${GOOD_SALT}", "4 fields"),
    (f"pbkdf2-sha256$1000${GOOD_SALT}${GOOD_DIGEST}$extra", "4 fields"),
    (f"pbkdf2-sha1$1000${GOOD_SALT}${GOOD_DIGEST}", "unknown scheme 'pbkdf2-sha1'"),
    (f"$pbkdf2-sha256$1000${GOOD_SALT}${GOOD_DIGEST}", "4 fields"),
    (f"pbkdf2-sha256$many${GOOD_SALT}${GOOD_DIGEST}", "not a decimal integer"),
    (f"pbkdf2-sha256$-5${GOOD_SALT}${GOOD_DIGEST}", "not a decimal integer"),
    (f"pbkdf2-sha256$\u0661\u0660\u0660\u0660${GOOD_SALT}${GOOD_DIGEST}", "not a decimal integer"),
    (f"pbkdf2-sha256$0${GOOD_SALT}${GOOD_DIGEST}", "outside"),
    (f"pbkdf2-sha256$99999999999${GOOD_SALT}${GOOD_DIGEST}", "outside"),
    (f"pbkdf2-sha256$1000$not base64!${GOOD_DIGEST}", "salt is not valid base64"),
    (f"pbkdf2-sha256$1000$${GOOD_DIGEST}", "salt is 0 bytes"),
    (f"pbkdf2-sha256$1000${b64(b'1234')}${GOOD_DIGEST}", "salt is 4 bytes"),
    (f"pbkdf2-sha256$1000${GOOD_SALT}$@@@@", "hash is not valid base64"),
    (f"pbkdf2-sha256$1000${GOOD_SALT}${b64(bytes(20))}", "hash is 20 bytes"),
    (f"pbkdf2-sha256$1000${GOOD_SALT}${GOOD_DIGEST[:-1]}", "hash is not valid base64"),
]


@pytest.mark.parametrize(("stored", "problem"), MALFORMED)
def test_check_hash_format_messages(stored: str, problem: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        check_hash_format(stored)
    message = str(excinfo.value)
    assert problem in message
    assert HASH_FORMAT in message  # always shows the expected format


@pytest.mark.parametrize(("stored", "problem"), MALFORMED)
def test_verify_malformed_hash_is_false(stored: str, problem: str) -> None:
    assert verify_password(stored, "anything") is False


def test_check_hash_format_does_not_echo_secrets() -> None:
    secret_salt = b64(b"SUPERSECRETSALT!")
    with pytest.raises(ValueError) as excinfo:
        check_hash_format(f"pbkdf2-sha256$1000${secret_salt}${b64(bytes(31))}")
    assert secret_salt not in str(excinfo.value)


def test_check_hash_format_accepts_valid() -> None:
    check_hash_format(f"pbkdf2-sha256$1000${GOOD_SALT}${GOOD_DIGEST}")
    check_hash_format(hash_password("x", iterations=FAST))


def test_check_hash_format_non_string() -> None:
    with pytest.raises(ValueError, match="expected a string"):
        check_hash_format(None)  # type: ignore[arg-type]


# --- Authenticator ------------------------------------------------------------------------


@pytest.fixture
def users() -> dict[str, str]:
    return {
        "alice": hash_password("alice-pw", iterations=FAST),
        "bob": hash_password("bob-pw", iterations=FAST),
        "carol": hash_password("carol-pw", iterations=FAST),
    }


@pytest.mark.parametrize(
    ("have_users", "require_auth", "expected"),
    [
        (True, True, ["PLAIN"]),
        (True, False, ["PLAIN", "ANONYMOUS"]),
        (False, False, ["ANONYMOUS"]),
        (False, True, []),
    ],
)
def test_mechanisms(
    users: dict[str, str], have_users: bool, require_auth: bool, expected: list[str]
) -> None:
    a = Authenticator(users if have_users else {}, require_auth=require_auth)
    assert a.mechanisms() == expected
    assert a.require_auth is require_auth


def test_authenticate_plain(users: dict[str, str]) -> None:
    a = Authenticator(users, require_auth=True)
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert a.authenticate_plain("alice", "alice", "alice-pw") == "alice"
    assert a.authenticate_plain("", "alice", "bob-pw") is None
    assert a.authenticate_plain("", "nobody", "alice-pw") is None
    assert a.authenticate_plain("", "", "") is None


def test_authzid_of_another_user_is_refused(users: dict[str, str]) -> None:
    a = Authenticator(users, require_auth=True)
    assert a.authenticate_plain("bob", "alice", "alice-pw") is None


def test_constructor_validates_hashes(users: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"user 'mallory': invalid password hash.*4 fields"):
        Authenticator({**users, "mallory": "hunter2"}, require_auth=True)
    with pytest.raises(ValueError, match="empty"):
        Authenticator({"": users["alice"]}, require_auth=True)
    with pytest.raises(ValueError, match="cache_size"):
        Authenticator(users, require_auth=True, cache_size=-1)


def test_users_mapping_is_copied(users: dict[str, str]) -> None:
    a = Authenticator(users, require_auth=True)
    users.clear()
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"


def test_success_is_cached(users: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(users, require_auth=True)
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert a.authenticate_plain("alice", "alice", "alice-pw") == "alice"
    assert derive_calls == [FAST]
    assert a.cache_len == 1


def test_failures_are_not_cached(users: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(users, require_auth=True)
    for _ in range(3):
        assert a.authenticate_plain("", "alice", "wrong") is None
    assert len(derive_calls) == 3
    assert a.cache_len == 0
    # A cached success does not make a different password succeed.
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert a.authenticate_plain("", "alice", "alice-pw2") is None
    assert a.authenticate_plain("", "bob", "alice-pw") is None


def test_unknown_user_costs_a_derivation(users: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(users, require_auth=True)
    assert a.authenticate_plain("", "nobody", "x") is None
    assert derive_calls == [FAST]  # as many iterations as the configured users


def test_cache_is_bounded_lru(users: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(users, require_auth=True, cache_size=2)
    for name in ("alice", "bob", "carol"):
        assert a.authenticate_plain("", name, f"{name}-pw") == name
    assert a.cache_len == 2
    assert len(derive_calls) == 3
    # carol and bob are cached, alice was evicted (least recently used).
    assert a.authenticate_plain("", "carol", "carol-pw") == "carol"
    assert a.authenticate_plain("", "bob", "bob-pw") == "bob"
    assert len(derive_calls) == 3
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert len(derive_calls) == 4
    assert a.cache_len == 2
    # bob was used after carol, so carol went when alice came back.
    assert a.authenticate_plain("", "bob", "bob-pw") == "bob"
    assert len(derive_calls) == 4
    assert a.authenticate_plain("", "carol", "carol-pw") == "carol"
    assert len(derive_calls) == 5


def test_cache_size_zero_disables_cache(users: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(users, require_auth=True, cache_size=0)
    for _ in range(2):
        assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    assert len(derive_calls) == 2
    assert a.cache_len == 0


def test_cache_holds_no_password(users: dict[str, str]) -> None:
    a = Authenticator(users, require_auth=True)
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"
    (key,) = a._cache
    assert isinstance(key, bytes)
    assert b"alice" not in key


def test_default_cache_size_is_sane(users: dict[str, str]) -> None:
    a = Authenticator(users, require_auth=True)
    assert 16 <= a._cache_size <= 100_000
