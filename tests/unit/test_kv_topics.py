"""`kv_topics.is_host_of`: whether a ZeroMQ peer address is the host of a pool endpoint (central mode's
`verifyPeer`)."""

from __future__ import annotations

import pytest

from epp.sources.kv_topics import is_host_of


@pytest.mark.parametrize(
    ("peer", "pod", "same"),
    [
        ("10.0.0.7", "10.0.0.7:8000", True),
        ("::ffff:10.0.0.7", "10.0.0.7:8000", True),  # a dual-stack socket's IPv4 peer
        ("fd00::7", "[fd00::7]:8000", True),
        ("fd00:0::7", "[fd00::7]:8000", True),  # the same address, written another way
        ("fe80::1%eth0", "[fe80::1]:8000", True),  # (a zone is not part of the address)
        ("10.0.0.8", "10.0.0.7:8000", False),
        ("::ffff:10.0.0.8", "10.0.0.7:8000", False),
        ("127.0.0.6", "10.0.0.7:8000", False),  # a sidecar proxy's source address
        ("", "10.0.0.7:8000", False),  # no peer address (not TCP)
        ("not an address", "10.0.0.7:8000", False),
        ("10.0.0.7", "vllm-0.example:8000", False),  # an endpoint not named by IP is nobody's host
    ],
)
def test_is_host_of(peer: str, pod: str, same: bool) -> None:
    assert is_host_of(peer, pod) is same
