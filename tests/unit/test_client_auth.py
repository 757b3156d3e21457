"""The CLI's SCRAM-SHA-256 client (`protocol.client_auth.ScramClient`) against scramp's
server side, an independent implementation: a right password logs in and the server's
signature verifies; a wrong password, a forged server signature and a server nonce
that does not extend ours are refused."""

from __future__ import annotations

import pytest
import scramp

from amqbroker.protocol.client_auth import ClientAuthError, ScramClient

MECH = scramp.ScramMechanism("SCRAM-SHA-256")


def server(password: str) -> scramp.ScramServer:
    auth = MECH.make_auth_info(password, iteration_count=4096)
    return MECH.make_server(lambda user: auth)


def test_logs_in_and_checks_the_server_signature() -> None:
    s = server("pw")
    c = ScramClient("bob", "pw")
    s.set_client_first(c.client_first().decode())
    final = c.client_final(s.get_server_first().encode())
    s.set_client_final(final.decode())  # raises if the proof is wrong
    c.verify_server_final(s.get_server_final().encode())
    with pytest.raises(ClientAuthError, match="signature is wrong"):
        c.verify_server_final(b"v=" + b"A" * 44)


def test_wrong_password_fails_at_the_server() -> None:
    s = server("pw")
    c = ScramClient("bob", "not-pw")
    s.set_client_first(c.client_first().decode())
    final = c.client_final(s.get_server_first().encode())
    with pytest.raises(scramp.ScramException):
        s.set_client_final(final.decode())


def test_a_server_nonce_that_does_not_extend_ours_is_refused() -> None:
    c = ScramClient("bob", "pw", nonce="abc")
    assert c.client_first() == b"n,,n=bob,r=abc"
    with pytest.raises(ClientAuthError, match="nonce"):
        c.client_final(b"r=xyz123,s=c2FsdHNhbHRzYWx0,i=4096")
    with pytest.raises(ClientAuthError, match="r=, s= or i="):
        c.client_final(b"r=abcdef")
