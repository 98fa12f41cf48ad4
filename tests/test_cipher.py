"""The Raft traffic cipher: what one secret seals, only that secret opens."""

from __future__ import annotations

import pytest

from quorumq.raft.cipher import AuthenticationError, RaftCipher


def test_sealed_data_opens_with_the_same_secret_and_keeps_its_timestamp() -> None:
    cipher = RaftCipher("s3cret")
    token = cipher.encrypt_at_time(b"append entries", 1234)
    assert b"append entries" not in token
    assert RaftCipher("s3cret").extract_timestamp(token) == 1234
    assert RaftCipher("s3cret").decrypt(token) == b"append entries"
    assert cipher.encrypt_at_time(b"append entries", 1234) != token  # a fresh IV each time


def test_another_secret_or_any_tampering_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    token = RaftCipher("s3cret").encrypt_at_time(b"vote for me", 7)
    with pytest.raises(AuthenticationError):
        RaftCipher("other").decrypt(token)
    assert "failed authentication" in caplog.text
    cipher = RaftCipher("s3cret")
    for i in range(len(token)):  # the timestamp, IV, ciphertext and tag are all covered
        forged = token[:i] + bytes([token[i] ^ 1]) + token[i + 1 :]
        with pytest.raises(AuthenticationError):
            cipher.decrypt(forged)
    with pytest.raises(AuthenticationError):
        cipher.extract_timestamp(b"\x01short")
