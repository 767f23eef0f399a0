"""Secrets never ride Ray's control channel in clear to another machine
(issue 33, finding 5): with Ray's TLS off, the Ray backend refuses a cluster
with a node anywhere but this machine, before any actor (and the
certificate key and KV secret it carries) is sent; nodes on loopback or on
this machine's own addresses pass."""

from __future__ import annotations

import socket

import pytest

from kvrelay.launch.ray_backend import RayPlaintext, check_nodes_local, is_this_machine


def own_address() -> str:
    """An address of this machine's own (the one it would reach the network from), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks the source
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def node(address: str, alive: bool = True) -> dict:
    return {"NodeID": "ab" * 28, "NodeManagerAddress": address, "Alive": alive}


def test_nodes_on_this_machine_pass():
    assert is_this_machine("127.0.0.1") and is_this_machine("::1") and is_this_machine(own_address())
    check_nodes_local([node("127.0.0.1"), node(own_address())])


def test_a_node_elsewhere_is_refused_naming_it():
    assert not is_this_machine("192.0.2.1") and not is_this_machine("not an address")
    with pytest.raises(RayPlaintext, match=r"Ray node abababababab is at 192\.0\.2\.1, not on this machine"):
        check_nodes_local([node("127.0.0.1"), node("192.0.2.1")])
    check_nodes_local([node("127.0.0.1"), node("192.0.2.1", alive=False)])  # a dead node receives nothing
