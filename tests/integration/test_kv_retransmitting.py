"""kvtransfer.wire.retransmitting on a real TCP connection across a veth link
between two network namespaces of the test's own: 0 while the link carries
the data, > 0 once the link is down and the kernel resends on its timer (what
the KV sender reads to retire a connection a cut left stuck). Root only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

NS_A, NS_B, ADDR_A, ADDR_B = "kvrt-a", "kvrt-b", "10.254.77.1", "10.254.77.2"
CLIENT = f"""
import socket, sys
from kvrelay.kvtransfer.wire import retransmitting
s = socket.create_connection(("{ADDR_B}", 5999), timeout=10)
print(retransmitting(s), flush=True)
sys.stdin.readline()
s.setblocking(False)
try:
    s.send(b"x" * 65536)
except BlockingIOError:
    pass
print("sent", flush=True)
while sys.stdin.readline():
    print(retransmitting(s), flush=True)
"""
SERVER = f"""
import socket, time
listener = socket.create_server(("{ADDR_B}", 5999))
print("ready", flush=True)
conn, _ = listener.accept()
time.sleep(60)
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        ip("netns", "add", ns)
    try:
        ip("link", "add", "kvrt-a0", "type", "veth", "peer", "name", "kvrt-b0")
        for ns, dev, addr in ((NS_A, "kvrt-a0", ADDR_A), (NS_B, "kvrt-b0", ADDR_B)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_A, NS_B):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_connection_whose_link_went_down_reads_as_retransmitting(two_hosts):
    server = subprocess.Popen(["ip", "netns", "exec", NS_B, sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout.readline().strip() == "ready"
    client = subprocess.Popen(["ip", "netns", "exec", NS_A, sys.executable, "-c", CLIENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "False"  # connected, nothing outstanding
        ip("-n", NS_B, "link", "set", "kvrt-b0", "down")  # the cut
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "sent"
        seen = []
        for _ in range(40):  # the first retransmission timeout is ~200 ms; 20 s for a busy machine
            time.sleep(0.5)
            client.stdin.write("\n")
            client.stdin.flush()
            seen.append(client.stdout.readline().strip())
            if seen[-1] == "True":
                break
        assert seen[-1] == "True", seen
    finally:
        client.kill()
        server.kill()
