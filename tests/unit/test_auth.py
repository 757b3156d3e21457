"""Password hashing, verification, the user table and its verification cache."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
import scramp

from amqbroker.core import auth
from amqbroker.core.auth import (
    HASH_FORMAT,
    SCRAM_HASH_FORMAT,
    Authenticator,
    ScramCredentials,
    check_hash_format,
    hash_password,
    hash_password_scram,
    saslprep,
    scram_verify,
    verify_password,
)
from amqbroker.settings import Settings, SettingsError, load_settings

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


# --- scram-sha-256 credentials --------------------------------------------------------------

RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")


def scram_reference(password: bytes, salt: bytes, iterations: int) -> tuple[bytes, bytes]:
    """StoredKey and ServerKey computed independently of the module (RFC 5802 section 3)."""
    salted = hashlib.pbkdf2_hmac("sha256", password, salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    return (
        hashlib.sha256(client_key).digest(),
        hmac.new(salted, b"Server Key", "sha256").digest(),
    )


def test_scram_hash_known_vector() -> None:
    stored = hash_password_scram("pencil", iterations=4096, salt=RFC_SALT)
    stored_key, server_key = scram_reference(b"pencil", RFC_SALT, 4096)
    assert stored == (
        f"scram-sha-256$4096$W22ZaJ0SNY7soEsUEjb6gQ==${b64(stored_key)}${b64(server_key)}"
    )
    check_hash_format(stored)
    assert verify_password(stored, "pencil")
    assert not verify_password(stored, "pencil ")


def test_scram_hash_matches_scramp() -> None:
    """scramp (an independent implementation) derives the same server credentials."""
    salt, stored_key, server_key, iterations = scramp.ScramMechanism().make_auth_info(
        "pässwörd", iteration_count=5000, salt=SALT
    )
    ours = hash_password_scram("pässwörd", iterations=5000, salt=SALT)
    assert ours == f"scram-sha-256$5000${b64(salt)}${b64(stored_key)}${b64(server_key)}"
    assert iterations == 5000


def test_scram_hash_defaults() -> None:
    stored = hash_password_scram("x")
    scheme, iterations, salt, stored_key, server_key = stored.split("$")
    assert (scheme, iterations) == ("scram-sha-256", "200000")
    assert len(base64.b64decode(salt)) == 16
    assert len(base64.b64decode(stored_key)) == len(base64.b64decode(server_key)) == 32
    assert hash_password_scram("x", iterations=4096) != hash_password_scram("x", iterations=4096)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"iterations": 4095}, "at least 4096"),
        ({"iterations": 10**9}, "iterations"),
        ({"salt": b"elevenbytes"}, "salt must be at least 12 bytes"),
    ],
)
def test_scram_hash_rejects_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hash_password_scram("x", **kwargs)  # type: ignore[arg-type]


def test_scram_hash_applies_saslprep() -> None:
    # U+00AD (soft hyphen) is mapped to nothing, U+2168 (ROMAN NUMERAL NINE) to "IX"
    stored = hash_password_scram("I\u00adX", iterations=4096, salt=SALT)
    assert stored == hash_password_scram("\u2168", iterations=4096, salt=SALT)
    assert stored == hash_password_scram("IX", iterations=4096, salt=SALT)
    assert verify_password(stored, "IX") and verify_password(stored, "I\u00adX")
    with pytest.raises(ValueError, match="U\\+0007"):
        hash_password_scram("bell\u0007", iterations=4096)


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # RFC 4013 section 3
        ("I\u00adX", "IX"),
        ("user", "user"),
        ("USER", "USER"),
        ("\u00aa", "a"),
        ("\u2168", "IX"),
        ("a\u00a0b", "a b"),  # non-ASCII space -> SPACE
    ],
)
def test_saslprep_examples(text: str, expected: str) -> None:
    assert saslprep(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("\u0007", "control"),  # RFC 4013 example 6
        ("\u0627\u0031", "right-to-left"),  # RFC 4013 example 7
        ("\u0627a\u0627", "mixes right-to-left and left-to-right"),
        ("a\ue000", "prohibited"),  # private use
        ("a\u0221", "unassigned"),  # unassigned in Unicode 3.2
    ],
)
def test_saslprep_refusals(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        saslprep(text)


def test_saslprep_query_mode_allows_unassigned() -> None:
    assert saslprep("a\u0221", allow_unassigned=True) == "a\u0221"


SCRAM_GOOD = f"scram-sha-256$4096${GOOD_SALT}${GOOD_DIGEST}${GOOD_DIGEST}"  # shape only
SCRAM_MALFORMED: list[tuple[str, str]] = [
    ("scram-sha-256", "5 fields"),
    (f"scram-sha-256$4096${GOOD_SALT}${GOOD_DIGEST}", "5 fields"),
    (f"{SCRAM_GOOD}$x", "5 fields"),
    (f"scram-sha-256$4095${GOOD_SALT}${GOOD_DIGEST}${GOOD_DIGEST}", "outside 4096..10000000"),
    (f"scram-sha-256$lots${GOOD_SALT}${GOOD_DIGEST}${GOOD_DIGEST}", "not a decimal integer"),
    (f"scram-sha-256$4096$!!${GOOD_DIGEST}${GOOD_DIGEST}", "salt is not valid base64"),
    (f"scram-sha-256$4096${b64(bytes(11))}${GOOD_DIGEST}${GOOD_DIGEST}", "salt is 11 bytes"),
    (f"scram-sha-256$4096${GOOD_SALT}$@${GOOD_DIGEST}", "StoredKey is not valid base64"),
    (f"scram-sha-256$4096${GOOD_SALT}${GOOD_DIGEST}${b64(bytes(31))}", "ServerKey is 31 bytes"),
]


@pytest.mark.parametrize(("stored", "problem"), SCRAM_MALFORMED)
def test_scram_check_hash_format_messages(stored: str, problem: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        check_hash_format(stored)
    assert problem in str(excinfo.value)
    assert SCRAM_HASH_FORMAT in str(excinfo.value)
    assert verify_password(stored, "anything") is False


def test_check_hash_format_accepts_scram() -> None:
    check_hash_format(SCRAM_GOOD)
    check_hash_format(hash_password_scram("x", iterations=4096))


def test_unknown_scheme_names_both_formats() -> None:
    with pytest.raises(ValueError, match="supported: 'pbkdf2-sha256', 'scram-sha-256'"):
        check_hash_format(f"md5$1000${GOOD_SALT}${GOOD_DIGEST}")


def test_scram_verify() -> None:
    stored_key, server_key = scram_reference(b"pencil", RFC_SALT, 4096)
    creds = ScramCredentials(4096, RFC_SALT, stored_key, server_key)
    auth_message = b"n=user,r=abc,r=abcdef,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,c=biws,r=abcdef"
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", RFC_SALT, 4096)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    signature = hmac.new(stored_key, auth_message, "sha256").digest()
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    assert scram_verify(creds, auth_message, proof) == (
        hmac.new(server_key, auth_message, "sha256").digest()
    )
    assert scram_verify(creds, auth_message + b"x", proof) is None
    assert scram_verify(creds, auth_message, bytes(32)) is None
    assert scram_verify(creds, auth_message, proof[:31]) is None


# --- Authenticator: SCRAM, EXTERNAL, anonymous policy -----------------------------------------


@pytest.fixture
def mixed() -> dict[str, str]:
    return {
        "alice": hash_password("alice-pw", iterations=FAST),
        "sam": hash_password_scram("sam-pw", iterations=4096),
        "sue": hash_password_scram("sue-pw", iterations=5000),
    }


@pytest.mark.parametrize(
    ("users", "require_auth", "allow_anonymous", "identity", "expected"),
    [
        ("mixed", False, True, None, ["SCRAM-SHA-256", "PLAIN", "ANONYMOUS"]),
        ("mixed", True, True, "CN=x", ["EXTERNAL", "SCRAM-SHA-256", "PLAIN"]),
        ("mixed", False, False, None, ["SCRAM-SHA-256", "PLAIN"]),
        ("pbkdf2", False, True, None, ["PLAIN", "ANONYMOUS"]),
        ("none", False, True, "CN=x", ["EXTERNAL", "ANONYMOUS"]),
        ("none", True, True, "CN=x", ["EXTERNAL"]),
        ("none", False, False, None, []),
    ],
)
def test_mechanisms_with_policy(
    mixed: dict[str, str],
    users: str,
    require_auth: bool,
    allow_anonymous: bool,
    identity: str | None,
    expected: list[str],
) -> None:
    table = {"mixed": mixed, "pbkdf2": {"alice": mixed["alice"]}, "none": {}}[users]
    a = Authenticator(
        table,
        require_auth=require_auth,
        allow_anonymous=allow_anonymous,
        tls_users={"CN=x": "x"},
    )
    assert a.mechanisms(identity) == expected
    assert a.anonymous_allowed is (allow_anonymous and not require_auth)
    assert a.require_auth is not a.anonymous_allowed


def test_plain_with_scram_credentials(mixed: dict[str, str], derive_calls: list[int]) -> None:
    a = Authenticator(mixed, require_auth=True)
    assert a.authenticate_plain("", "sam", "sam-pw") == "sam"
    assert a.authenticate_plain("", "sam", "sam-pw") == "sam"  # cached
    assert derive_calls == [4096]
    assert a.authenticate_plain("", "sam", "sue-pw") is None
    assert a.authenticate_plain("", "sam", "bell\u0007") is None  # SASLprep refuses it
    assert derive_calls == [4096, 4096, 4096]  # failures cost the same work
    assert a.authenticate_plain("", "alice", "alice-pw") == "alice"


def test_scram_credentials(mixed: dict[str, str]) -> None:
    a = Authenticator(mixed, require_auth=True)
    creds, problem = a.scram_credentials("sue")
    assert problem is None
    assert creds.iterations == 5000
    assert b64(creds.salt) == mixed["sue"].split("$")[2]
    assert b64(creds.stored_key) == mixed["sue"].split("$")[3]
    fake1, problem = a.scram_credentials("nobody")
    assert problem == "no such user"
    fake2, _ = a.scram_credentials("nobody")
    assert fake1.salt == fake2.salt and len(fake1.salt) == 16
    assert fake1.stored_key != fake2.stored_key  # random: no proof can match
    assert fake1.iterations == 4096  # the first SCRAM user's count, like a real user
    assert a.scram_credentials("somebody-else")[0].salt != fake1.salt
    _, problem = a.scram_credentials("alice")
    assert problem is not None and "hash-password --scram" in problem
    # the fake salt is the same after a restart with the same configuration ...
    assert Authenticator(mixed, require_auth=True).scram_credentials("nobody")[0].salt == (
        fake1.salt
    )
    # ... and cannot be computed without the configured credentials
    other = {**mixed, "sue": hash_password_scram("sue-pw", iterations=5000)}
    assert Authenticator(other, require_auth=True).scram_credentials("nobody")[0].salt != (
        fake1.salt
    )


def test_tls_users(mixed: dict[str, str]) -> None:
    a = Authenticator(mixed, require_auth=True, tls_users={"CN=app,O=Example": "app"})
    assert a.tls_user("CN=app,O=Example") == "app"
    assert a.tls_user("CN=app") is None
    with pytest.raises(ValueError, match="must not be empty"):
        Authenticator({}, require_auth=True, tls_users={"": "app"})


# --- the settings that feed the Authenticator ---------------------------------------------


def test_settings_allow_anonymous_false_needs_a_way_in() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"AMQBROKER_ALLOW_ANONYMOUS": "false"})
    message = str(info.value)
    assert "allow_anonymous = false (from AMQBROKER_ALLOW_ANONYMOUS)" in message
    assert "no client could connect" in message
    assert "amqbroker hash-password --scram" in message
    assert "[tls_identity_users]" in message


def test_settings_tls_identity_users_alone_satisfy_require_auth() -> None:
    s = load_settings(
        environ={
            "AMQBROKER_REQUIRE_AUTH": "true",
            "AMQBROKER_TLS_IDENTITY_USERS": '{"CN=app,O=Example": "app"}',
        }
    )
    assert s.tls_identity_users == {"CN=app,O=Example": "app"}
    assert s.allow_anonymous is True  # but require_auth wins:
    a = Authenticator(
        s.users,
        require_auth=s.require_auth,
        allow_anonymous=s.allow_anonymous,
        tls_users=s.tls_identity_users,
    )
    assert a.mechanisms() == [] and a.mechanisms("CN=app,O=Example") == ["EXTERNAL"]


def test_settings_accept_scram_hashes_and_refuse_weak_ones() -> None:
    stored = hash_password_scram("pw", iterations=4096)
    assert load_settings(environ={"AMQBROKER_USERS": f'{{"bob": "{stored}"}}'}).users == {
        "bob": stored
    }
    weak = f"scram-sha-256$1000${GOOD_SALT}${GOOD_DIGEST}${GOOD_DIGEST}"
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"AMQBROKER_USERS": f'{{"bob": "{weak}"}}'})
    assert "users.bob = <hidden>" in str(info.value)
    assert "outside 4096..10000000" in str(info.value)
    assert GOOD_SALT not in str(info.value)


def test_defaults_keep_anonymous_access() -> None:
    s = Settings()
    assert (s.require_auth, s.allow_anonymous, s.tls_identity_users) == (False, True, {})
