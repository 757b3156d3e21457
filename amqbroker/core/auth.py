"""Users, password hashes and credential checks (PLAIN, SCRAM-SHA-256, EXTERNAL).

Theory of operation
-------------------
The broker never stores passwords. A user's stored credential is one of two text
formats:

``pbkdf2-sha256$<iterations>$<salt base64>$<hash base64>``
    PBKDF2-HMAC-SHA256 of the password (`hash_password`). Works with SASL PLAIN only.
    (The hash is exactly SCRAM's SaltedPassword, so accepting it for SCRAM would turn
    the stored value into a login credential: it is deliberately not offered.)

``scram-sha-256$<iterations>$<salt base64>$<StoredKey base64>$<ServerKey base64>``
    The RFC 5802 / RFC 7677 server credentials (`hash_password_scram`): the password
    is prepared with SASLprep (RFC 4013), SaltedPassword = PBKDF2-HMAC-SHA256(password,
    salt, iterations), StoredKey = SHA-256(HMAC(SaltedPassword, "Client Key")),
    ServerKey = HMAC(SaltedPassword, "Server Key"). At least 4096 iterations (RFC 7677).
    Works with SCRAM-SHA-256 and with PLAIN (the server recomputes StoredKey from the
    password). A stolen value does not let anyone log in (it would let them pose as the
    server to a SCRAM client, and guess passwords offline at `iterations` per guess).

`check_hash_format` says precisely what is wrong with a stored value (settings
validation); `verify_password` checks a password against either format in constant
time.

`Authenticator` holds the user table (name -> stored credential), the TLS identity
table (certificate subject -> user name) and the policy: anonymous access is allowed
exactly when ``allow_anonymous and not require_auth``. It says which SASL mechanisms a
connection is offered (`mechanisms`), checks PLAIN credentials, hands out SCRAM
credentials (`scram_credentials`) and maps TLS identities (`tls_user`). The SCRAM
message exchange itself is in `amqbroker.protocol.sasl`; `scram_verify` is its
cryptographic step. Nothing here knows about AMQP.

PBKDF2 with 200k iterations costs a noticeable fraction of a second of CPU, so
successful PLAIN verifications are remembered in a small LRU cache. The cache key is an
HMAC (under a random per-Authenticator key) of user, password and stored hash, so the
cache holds no password, cannot be used for a fast offline guessing attack without the
process's key, and goes stale by itself when a user's stored hash changes. Failures are
never cached (a wrong password always costs a full PBKDF2 run). A SCRAM exchange costs
the server a few HMACs only: the client does the PBKDF2.

Invariants
----------
- Every stored credential in an `Authenticator` passed `check_hash_format` (checked in
  the constructor), so verification can only fail because the password is wrong.
- An unknown user costs the same PBKDF2 work as a known one in PLAIN, and gets a SCRAM
  exchange indistinguishable from a known user's: a salt that is the same on every
  attempt for that name (HMAC of the name under a key derived from the configured
  credentials) and the iteration count of the first SCRAM user (no user enumeration
  by salt, iteration count or timing); digests are compared with
  `hmac.compare_digest`.
- The cache never holds more than `cache_size` entries and is safe to use from several
  threads (the broker may verify credentials in worker threads).
- pbkdf2-sha256 passwords are compared as their exact UTF-8 encoding (no
  normalisation, as before); scram-sha-256 passwords go through SASLprep first, on
  both hashing and PLAIN login, as RFC 5802 requires (SCRAM clients prep them too).

stdlib only: this module must not import proton, trio, click or anything else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import stringprep
import threading
import unicodedata
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "DEFAULT_ITERATIONS",
    "HASH_FORMAT",
    "SCHEME",
    "SCRAM_HASH_FORMAT",
    "SCRAM_MIN_ITERATIONS",
    "SCRAM_SCHEME",
    "Authenticator",
    "ScramCredentials",
    "check_hash_format",
    "hash_password",
    "hash_password_scram",
    "saslprep",
    "scram_verify",
    "verify_password",
]

SCHEME = "pbkdf2-sha256"
HASH_FORMAT = "pbkdf2-sha256$<iterations>$<salt base64>$<hash base64>"
SCRAM_SCHEME = "scram-sha-256"
SCRAM_HASH_FORMAT = "scram-sha-256$<iterations>$<salt base64>$<StoredKey base64>$<ServerKey base64>"
DEFAULT_ITERATIONS = 200_000
MIN_ITERATIONS = 1
SCRAM_MIN_ITERATIONS = 4096  # RFC 7677 section 4
MAX_ITERATIONS = 10_000_000  # bounds the CPU one verification may cost
SALT_BYTES = 16
MIN_SALT_BYTES = 8
SCRAM_MIN_SALT_BYTES = 12  # what SCRAM clients such as scramp accept
HASH_BYTES = 32  # SHA-256 output size
DEFAULT_CACHE_SIZE = 1024

_EXAMPLE = "e.g. 'pbkdf2-sha256$200000$c2FsdHNhbHRzYWx0c2FsdA==$<44 base64 characters>'"
_SCRAM_EXAMPLE = (
    "e.g. 'scram-sha-256$200000$c2FsdHNhbHRzYWx0c2FsdA==$<44 base64 characters>"
    "$<44 base64 characters>'"
)
_CLIENT_KEY = b"Client Key"
_SERVER_KEY = b"Server Key"


class ScramCredentials(NamedTuple):
    """What a SCRAM-SHA-256 server stores for one user (RFC 5802 section 3)."""

    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes


class _Parsed(NamedTuple):
    iterations: int
    salt: bytes
    digest: bytes


_Stored = _Parsed | ScramCredentials


def _derive(password: str, salt: bytes, iterations: int, dklen: int = HASH_BYTES) -> bytes:
    secret = password.encode("utf-8", "surrogatepass")
    return hashlib.pbkdf2_hmac("sha256", secret, salt, iterations, dklen)


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, "sha256").digest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


# --- SASLprep (RFC 4013, a stringprep profile) ---------------------------------------------


def saslprep(text: str, *, allow_unassigned: bool = False) -> str:
    """Prepare a password (or user name) with SASLprep; ValueError names the problem.

    `allow_unassigned` is stringprep's "query" mode (used at login); hashing uses the
    "stored string" mode, which refuses code points unassigned in Unicode 3.2.
    """
    # 1. map: non-ASCII spaces to SPACE, "commonly mapped to nothing" removed
    mapped = "".join(
        " " if stringprep.in_table_c12(c) else c for c in text if not stringprep.in_table_b1(c)
    )
    # 2. normalise (NFKC, Unicode 3.2 as stringprep specifies)
    prepared = unicodedata.ucd_3_2_0.normalize("NFKC", mapped)
    # 3. prohibited output, 4. unassigned code points
    for c in prepared:
        if stringprep.in_table_c12(c) or stringprep.in_table_c21_c22(c):
            raise ValueError(f"SASLprep: control or non-ASCII space character U+{ord(c):04X}")
        if (
            stringprep.in_table_c3(c)
            or stringprep.in_table_c4(c)
            or stringprep.in_table_c5(c)
            or stringprep.in_table_c6(c)
            or stringprep.in_table_c7(c)
            or stringprep.in_table_c8(c)
            or stringprep.in_table_c9(c)
        ):
            raise ValueError(f"SASLprep: prohibited character U+{ord(c):04X}")
        if not allow_unassigned and stringprep.in_table_a1(c):
            raise ValueError(f"SASLprep: U+{ord(c):04X} is unassigned in Unicode 3.2")
    # 5. bidirectional text (RFC 3454 section 6)
    if any(stringprep.in_table_d1(c) for c in prepared):
        if any(stringprep.in_table_d2(c) for c in prepared):
            raise ValueError("SASLprep: mixes right-to-left and left-to-right characters")
        if not (stringprep.in_table_d1(prepared[0]) and stringprep.in_table_d1(prepared[-1])):
            raise ValueError(
                "SASLprep: right-to-left text must start and end with a right-to-left character"
            )
    return prepared


# --- parsing and checking stored credentials ---------------------------------------------


def _bad(fmt: str, example: str, problem: str) -> ValueError:
    return ValueError(f"invalid password hash: {problem}; expected {fmt} ({example})")


def _parse_iterations(text: str, minimum: int, fmt: str, example: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise _bad(fmt, example, f"iterations {text[:32]!r} is not a decimal integer")
    iterations = int(text)
    if not minimum <= iterations <= MAX_ITERATIONS:
        raise _bad(fmt, example, f"iterations {iterations} is outside {minimum}..{MAX_ITERATIONS}")
    return iterations


def _parse_b64(text: str, what: str, fmt: str, example: str) -> bytes:
    data = _unb64(text)
    if data is None:
        raise _bad(fmt, example, f"the {what} is not valid base64")
    return data


def _parse(stored: str) -> _Stored:
    """Split and check a stored credential; ValueError names the problem and the format."""
    if not isinstance(stored, str):
        raise _bad(HASH_FORMAT, _EXAMPLE, f"expected a string, got {type(stored).__name__}")
    parts = stored.split("$")
    if parts[0] == SCRAM_SCHEME:
        return _parse_scram(parts)
    if len(parts) != 4:
        raise _bad(HASH_FORMAT, _EXAMPLE, f"expected 4 fields separated by '$', got {len(parts)}")
    scheme, iterations_text, salt_text, digest_text = parts
    if scheme != SCHEME:
        raise _bad(
            HASH_FORMAT,
            _EXAMPLE,
            f"unknown scheme {scheme[:32]!r} (supported: {SCHEME!r}, {SCRAM_SCHEME!r})",
        )
    iterations = _parse_iterations(iterations_text, MIN_ITERATIONS, HASH_FORMAT, _EXAMPLE)
    salt = _parse_b64(salt_text, "salt", HASH_FORMAT, _EXAMPLE)
    if len(salt) < MIN_SALT_BYTES:
        raise _bad(
            HASH_FORMAT,
            _EXAMPLE,
            f"the salt is {len(salt)} bytes, at least {MIN_SALT_BYTES} are required",
        )
    digest = _parse_b64(digest_text, "hash", HASH_FORMAT, _EXAMPLE)
    if len(digest) != HASH_BYTES:
        raise _bad(
            HASH_FORMAT,
            _EXAMPLE,
            f"the hash is {len(digest)} bytes, a SHA-256 hash is {HASH_BYTES}",
        )
    return _Parsed(iterations, salt, digest)


def _parse_scram(parts: list[str]) -> ScramCredentials:
    fmt, ex = SCRAM_HASH_FORMAT, _SCRAM_EXAMPLE
    if len(parts) != 5:
        raise _bad(fmt, ex, f"expected 5 fields separated by '$', got {len(parts)}")
    _, iterations_text, salt_text, stored_text, server_text = parts
    iterations = _parse_iterations(iterations_text, SCRAM_MIN_ITERATIONS, fmt, ex)
    salt = _parse_b64(salt_text, "salt", fmt, ex)
    if len(salt) < SCRAM_MIN_SALT_BYTES:
        raise _bad(
            fmt, ex, f"the salt is {len(salt)} bytes, at least {SCRAM_MIN_SALT_BYTES} are required"
        )
    keys = []
    for text, what in ((stored_text, "StoredKey"), (server_text, "ServerKey")):
        key = _parse_b64(text, what, fmt, ex)
        if len(key) != HASH_BYTES:
            raise _bad(fmt, ex, f"the {what} is {len(key)} bytes, a SHA-256 key is {HASH_BYTES}")
        keys.append(key)
    return ScramCredentials(iterations, salt, keys[0], keys[1])


def _scram_from_password(password: str, salt: bytes, iterations: int) -> ScramCredentials:
    """SCRAM credentials of an already SASLprep'ed password."""
    salted = _derive(password, salt, iterations)
    stored_key = hashlib.sha256(_hmac(salted, _CLIENT_KEY)).digest()
    return ScramCredentials(iterations, salt, stored_key, _hmac(salted, _SERVER_KEY))


def hash_password(
    password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> str:
    """Hash `password` as ``pbkdf2-sha256$<iterations>$<salt base64>$<hash base64>``.

    A random 16-byte salt is used unless `salt` is given (tests, reproducible fixtures).
    """
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be in {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    if salt is None:
        salt = secrets.token_bytes(SALT_BYTES)
    elif len(salt) < MIN_SALT_BYTES:
        raise ValueError(f"salt must be at least {MIN_SALT_BYTES} bytes")
    digest = _derive(password, salt, iterations)
    return f"{SCHEME}${iterations}${_b64(salt)}${_b64(digest)}"


def hash_password_scram(
    password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> str:
    """SCRAM-SHA-256 server credentials for `password`, in `SCRAM_HASH_FORMAT`.

    The password is prepared with SASLprep; ValueError when SASLprep prohibits it
    (control characters, unassigned code points, malformed bidirectional text) or for
    bad parameters (iterations below 4096, salt shorter than 12 bytes).
    """
    if not SCRAM_MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(
            f"iterations must be in {SCRAM_MIN_ITERATIONS}..{MAX_ITERATIONS} "
            "(RFC 7677 requires at least 4096 for SCRAM-SHA-256)"
        )
    if salt is None:
        salt = secrets.token_bytes(SALT_BYTES)
    elif len(salt) < SCRAM_MIN_SALT_BYTES:
        raise ValueError(f"salt must be at least {SCRAM_MIN_SALT_BYTES} bytes")
    creds = _scram_from_password(saslprep(password), salt, iterations)
    return (
        f"{SCRAM_SCHEME}${iterations}${_b64(salt)}"
        f"${_b64(creds.stored_key)}${_b64(creds.server_key)}"
    )


def check_hash_format(stored: str) -> None:
    """Raise ValueError saying what is wrong with `stored` (and the expected format).

    The message never repeats the salt, hash or keys, so it is safe to log.
    """
    _parse(stored)


def _verify(parsed: _Stored, password: str) -> bool:
    if isinstance(parsed, ScramCredentials):
        try:
            prepared = saslprep(password, allow_unassigned=True)
        except ValueError:
            prepared = password  # costs the same; cannot match a prepared password's keys
            ok = False
        else:
            ok = True
        candidate = _scram_from_password(prepared, parsed.salt, parsed.iterations)
        return hmac.compare_digest(candidate.stored_key, parsed.stored_key) and ok
    return hmac.compare_digest(_derive(password, parsed.salt, parsed.iterations), parsed.digest)


def verify_password(stored: str, password: str) -> bool:
    """True when `password` matches `stored` (either format); a malformed `stored` gives False."""
    try:
        return _verify(_parse(stored), password)
    except (ValueError, UnicodeEncodeError):
        return False


def scram_verify(creds: ScramCredentials, auth_message: bytes, proof: bytes) -> bytes | None:
    """Check a SCRAM ClientProof over `auth_message`; the ServerSignature if it is right.

    ClientKey = ClientProof XOR HMAC(StoredKey, AuthMessage); right when
    SHA-256(ClientKey) == StoredKey (RFC 5802 section 3).
    """
    if len(proof) != HASH_BYTES:
        return None
    signature = _hmac(creds.stored_key, auth_message)
    client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
    if not hmac.compare_digest(hashlib.sha256(client_key).digest(), creds.stored_key):
        return None
    return _hmac(creds.server_key, auth_message)


# --- the user table ------------------------------------------------------------------------


class Authenticator:
    """The user table and authentication policy, as the SASL layer sees it."""

    def __init__(
        self,
        users: Mapping[str, str],
        *,
        require_auth: bool,
        allow_anonymous: bool = True,
        tls_users: Mapping[str, str] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 0:
            raise ValueError("cache_size must be >= 0")
        parsed: dict[str, _Stored] = {}
        for name, stored in users.items():
            if not name:
                raise ValueError("user names must not be empty")
            try:
                parsed[name] = _parse(stored)
            except ValueError as exc:
                raise ValueError(f"user {name!r}: {exc}") from None
        self._tls_users: dict[str, str] = dict(tls_users or {})
        for subject, user in self._tls_users.items():
            if not subject or not user:
                raise ValueError("TLS identities and the user names they map to must not be empty")
        self._users: dict[str, str] = dict(users)
        self._parsed = parsed
        self._anonymous = allow_anonymous and not require_auth
        self._cache_size = cache_size
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._cache_key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        # An unknown user costs as many iterations as a (typical) real one.
        self._dummy_iterations = DEFAULT_ITERATIONS
        for entry in parsed.values():
            self._dummy_iterations = entry.iterations
            break
        self._scram_users = {n for n, p in parsed.items() if isinstance(p, ScramCredentials)}
        self._scram_dummy_iterations = next(
            (parsed[n].iterations for n in parsed if n in self._scram_users), DEFAULT_ITERATIONS
        )
        # Fake SCRAM salts must be stable for a name (a real user's salt never changes)
        # and unpredictable: keyed by the configured credentials, which are secret.
        fake = hashlib.sha256(b"amqbroker fake SCRAM salt\0")
        for name in sorted(users):
            fake.update(f"{len(name)}:{name}{users[name]}\0".encode("utf-8", "surrogatepass"))
        self._fake_salt_key = fake.digest()

    @property
    def require_auth(self) -> bool:
        """Every connection must authenticate (anonymous access is not allowed)."""
        return not self._anonymous

    @property
    def anonymous_allowed(self) -> bool:
        """ANONYMOUS is offered and a client may skip SASL (user "anonymous")."""
        return self._anonymous

    def mechanisms(self, tls_identity: str | None = None) -> list[str]:
        """SASL mechanisms to offer a connection, in order of preference.

        EXTERNAL only to a connection that presented a TLS client certificate
        (`tls_identity`, its subject); SCRAM-SHA-256 when some user has a SCRAM
        credential; PLAIN when there are users; ANONYMOUS when anonymous access is
        allowed.
        """
        mechs: list[str] = []
        if tls_identity is not None:
            mechs.append("EXTERNAL")
        if self._scram_users:
            mechs.append("SCRAM-SHA-256")
        if self._users:
            mechs.append("PLAIN")
        if self._anonymous:
            mechs.append("ANONYMOUS")
        return mechs

    def tls_user(self, identity: str) -> str | None:
        """The user a TLS client certificate subject maps to (tls_identity_users)."""
        return self._tls_users.get(identity)

    def scram_credentials(self, name: str) -> tuple[ScramCredentials, str | None]:
        """(credentials, problem) for a SCRAM-SHA-256 exchange with user `name`.

        problem is None for a user with a scram-sha-256 credential. Otherwise it says
        why this name cannot log in with SCRAM (for the broker's log, never for the
        client) and the credentials are fake: a salt stable for the name, the usual
        iteration count and random keys no proof can match.
        """
        entry = self._parsed.get(name)
        if isinstance(entry, ScramCredentials):
            return entry, None
        if entry is None:
            problem = "no such user"
        else:
            problem = (
                f"the user has a {SCHEME} hash, which works with PLAIN only; to allow "
                "SCRAM-SHA-256, re-hash the password with `amqbroker hash-password --scram`"
            )
        salt = _hmac(self._fake_salt_key, name.encode("utf-8", "surrogatepass"))[:SALT_BYTES]
        fake = ScramCredentials(
            self._scram_dummy_iterations,
            salt,
            secrets.token_bytes(HASH_BYTES),
            secrets.token_bytes(HASH_BYTES),
        )
        return fake, problem

    def authenticate_plain(self, authzid: str, authcid: str, password: str) -> str | None:
        """Check PLAIN credentials (RFC 4616); the authenticated user name, or None.

        `authzid` must be empty or equal to `authcid`: acting as another user is not
        supported. Works for both credential formats.
        """
        if authzid and authzid != authcid:
            return None
        stored = self._users.get(authcid)
        if stored is None:
            _derive(password, b"\0" * SALT_BYTES, self._dummy_iterations)  # same work
            return None
        key = self._key(authcid, password, stored)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return authcid
        try:
            ok = _verify(self._parsed[authcid], password)
        except UnicodeEncodeError:
            ok = False
        if not ok:
            return None
        self._remember(key)
        return authcid

    def _key(self, user: str, password: str, stored: str) -> bytes:
        mac = hmac.new(self._cache_key, digestmod="sha256")
        for part in (user, password, stored):
            data = part.encode("utf-8", "surrogatepass")
            mac.update(len(data).to_bytes(8, "big"))
            mac.update(data)
        return mac.digest()

    def _remember(self, key: bytes) -> None:
        if self._cache_size == 0:
            return
        with self._lock:
            self._cache[key] = None
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    @property
    def cache_len(self) -> int:
        """Number of cached successful verifications (for tests and metrics)."""
        with self._lock:
            return len(self._cache)
