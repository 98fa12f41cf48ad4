"""TLS for the clients: the `tls=` option as an `ssl.SSLContext`, and a failed handshake
as one `TlsError` that says what to change."""

from __future__ import annotations

import os
import ssl

from .core import TlsError

TlsOption = bool | str | os.PathLike[str] | ssl.SSLContext | None
"""A client's `tls=`: None or False, plain TCP; True, TLS verified against the system's
CAs; a path, TLS verified against the CA certificates in that PEM file; an
`ssl.SSLContext`, used as it is."""

_PLAIN_TEXT = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL"}
)
"""OpenSSL's reasons when the answer to a ClientHello is not TLS at all."""


def client_context(tls: TlsOption) -> ssl.SSLContext | None:
    """The context the client's connections use, or None for plain TCP. TLS 1.2 at
    least, the node's certificate verified and its host name checked (unless a given
    context says otherwise). `TlsError` if the CA file cannot be loaded."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    cafile = None if tls is True else os.fspath(tls)
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"cannot load the TLS CA file {cafile}: {e}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    return context


def handshake_failed(error: ssl.SSLError) -> TlsError:
    """What a failed TLS handshake with a node means, in one line."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return TlsError(
            f"the node's certificate did not verify: {error.verify_message} (it must be "
            "signed by the CA the client trusts, the CA file given as tls= or with True the "
            "system's CAs, and name the host the client dialled)"
        )
    if error.reason in _PLAIN_TEXT:
        return TlsError(
            f"the node did not answer in TLS ({error.reason}): it serves plain text "
            "(a node started without --tls-cert); connect without tls="
        )
    return TlsError(f"TLS handshake failed: {error.reason or error}")
