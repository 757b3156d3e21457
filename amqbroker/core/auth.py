"""Users, password hashes and credential checks.

Theory of operation
-------------------
The broker never stores passwords, only PBKDF2-HMAC-SHA256 hashes in one text format::

    pbkdf2-sha256$<iterations>$<salt base64>$<hash base64>

`hash_password` makes such a string (operators paste it into the settings),
`check_hash_format` says precisely what is wrong with one (settings validation), and
`verify_password` checks a password against one in constant time.

`Authenticator` holds the user table (name -> stored hash) and the policy
(`require_auth`): it says which SASL mechanisms the broker offers and checks PLAIN
credentials. The protocol layer (`amqbroker.protocol.sasl`) drives it; nothing here
knows about AMQP.

PBKDF2 with 200k iterations costs a noticeable fraction of a second of CPU, so
successful verifications are remembered in a small LRU cache. The cache key is an
HMAC (under a random per-Authenticator key) of user, password and stored hash, so the
cache holds no password, cannot be used for a fast offline guessing attack without the
process's key, and goes stale by itself when a user's stored hash changes. Failures are
never cached (a wrong password always costs a full PBKDF2 run).

Invariants
----------
- Every stored hash in an `Authenticator` passed `check_hash_format` (checked in the
  constructor), so verification can only fail because the password is wrong.
- An unknown user costs the same PBKDF2 work as a known one (no user enumeration by
  timing); digests are compared with `hmac.compare_digest`.
- The cache never holds more than `cache_size` entries and is safe to use from several
  threads (the broker may verify credentials in worker threads).
- Passwords are compared as their exact UTF-8 encoding (no SASLprep normalisation).

stdlib only: this module must not import proton, trio, click or anything else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "DEFAULT_ITERATIONS",
    "HASH_FORMAT",
    "SCHEME",
    "Authenticator",
    "check_hash_format",
    "hash_password",
    "verify_password",
]

SCHEME = "pbkdf2-sha256"
HASH_FORMAT = "pbkdf2-sha256$<iterations>$<salt base64>$<hash base64>"
DEFAULT_ITERATIONS = 200_000
MIN_ITERATIONS = 1
MAX_ITERATIONS = 10_000_000  # bounds the CPU one verification may cost
SALT_BYTES = 16
MIN_SALT_BYTES = 8
HASH_BYTES = 32  # SHA-256 output size
DEFAULT_CACHE_SIZE = 1024

_EXAMPLE = "e.g. 'pbkdf2-sha256$200000$c2FsdHNhbHRzYWx0c2FsdA==$<44 base64 characters>'"


class _Parsed(NamedTuple):
    iterations: int
    salt: bytes
    digest: bytes


def _derive(password: str, salt: bytes, iterations: int, dklen: int = HASH_BYTES) -> bytes:
    secret = password.encode("utf-8", "surrogatepass")
    return hashlib.pbkdf2_hmac("sha256", secret, salt, iterations, dklen)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


def _parse(stored: str) -> _Parsed:
    """Split and check a stored hash; ValueError names the problem and the format."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"invalid password hash: {problem}; expected {HASH_FORMAT} ({_EXAMPLE})")

    if not isinstance(stored, str):
        raise bad(f"expected a string, got {type(stored).__name__}")
    parts = stored.split("$")
    if len(parts) != 4:
        raise bad(f"expected 4 fields separated by '$', got {len(parts)}")
    scheme, iterations_text, salt_text, digest_text = parts
    if scheme != SCHEME:
        raise bad(f"unknown scheme {scheme[:32]!r} (only {SCHEME!r} is supported)")
    if not (iterations_text.isascii() and iterations_text.isdigit()):
        raise bad(f"iterations {iterations_text[:32]!r} is not a decimal integer")
    iterations = int(iterations_text)
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise bad(f"iterations {iterations} is outside {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    salt = _unb64(salt_text)
    if salt is None:
        raise bad("the salt is not valid base64")
    if len(salt) < MIN_SALT_BYTES:
        raise bad(f"the salt is {len(salt)} bytes, at least {MIN_SALT_BYTES} are required")
    digest = _unb64(digest_text)
    if digest is None:
        raise bad("the hash is not valid base64")
    if len(digest) != HASH_BYTES:
        raise bad(f"the hash is {len(digest)} bytes, a SHA-256 hash is {HASH_BYTES}")
    return _Parsed(iterations, salt, digest)


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


def check_hash_format(stored: str) -> None:
    """Raise ValueError saying what is wrong with `stored` (and the expected format).

    The message never repeats the salt or hash, so it is safe to log.
    """
    _parse(stored)


def verify_password(stored: str, password: str) -> bool:
    """True when `password` matches `stored`; a malformed `stored` gives False."""
    try:
        parsed = _parse(stored)
        candidate = _derive(password, parsed.salt, parsed.iterations)
    except (ValueError, UnicodeEncodeError):
        return False
    return hmac.compare_digest(candidate, parsed.digest)


class Authenticator:
    """The user table and authentication policy, as the SASL layer sees it."""

    def __init__(
        self,
        users: Mapping[str, str],
        *,
        require_auth: bool,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 0:
            raise ValueError("cache_size must be >= 0")
        for name, stored in users.items():
            if not name:
                raise ValueError("user names must not be empty")
            try:
                check_hash_format(stored)
            except ValueError as exc:
                raise ValueError(f"user {name!r}: {exc}") from None
        self._users: dict[str, str] = dict(users)
        self._require_auth = require_auth
        self._cache_size = cache_size
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._cache_key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        # An unknown user costs as many iterations as a (typical) real one.
        self._dummy_iterations = DEFAULT_ITERATIONS
        for stored in self._users.values():
            self._dummy_iterations = _parse(stored).iterations
            break

    @property
    def require_auth(self) -> bool:
        return self._require_auth

    def mechanisms(self) -> list[str]:
        """SASL mechanisms to offer, in order of preference."""
        mechs: list[str] = []
        if self._users:
            mechs.append("PLAIN")
        if not self._require_auth:
            mechs.append("ANONYMOUS")
        return mechs

    def authenticate_plain(self, authzid: str, authcid: str, password: str) -> str | None:
        """Check PLAIN credentials (RFC 4616); the authenticated user name, or None.

        `authzid` must be empty or equal to `authcid`: acting as another user is not
        supported.
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
        if not verify_password(stored, password):
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
