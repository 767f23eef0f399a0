"""The hostile-client figures of ``kvrelay bench fuzz`` (and the helpers
tests/integration/test_hardening.py asserts bounds with): how fast a 5 MB
prompt is refused, what a 200 MB chunked upload does to the router's memory,
how long 500 half-open connections live, whether heartbeats keep arriving
while large prompts flood in. Real sockets against a running LocalCluster."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import ssl
import threading
import time
from dataclasses import asdict, dataclass, field

import grpc

from kvrelay.launch.local import LocalCluster
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

CHAT = "/v1/chat/completions"
FIVE_MB = 5_000_000


def router_pid(cluster: LocalCluster) -> int:
    return next(c for c in cluster.children if c.name == "router").proc.pid


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


class RssPeak:
    """Samples a process's RSS every 10 ms while the ``with`` block runs; ``growth`` is peak minus start."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start, self.peak = pid, rss_bytes(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.01)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.start)


def tls_socket(cluster: LocalCluster, source: str = "127.0.0.1", timeout_s: float = 30.0) -> ssl.SSLSocket:
    host, _, port = cluster.http_address.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=timeout_s, source_address=(source, 0))
    return ssl.create_default_context(cafile=str(cluster.ca_file)).wrap_socket(raw, server_hostname=host)


def read_all(s: socket.socket) -> bytes:
    """Everything until the peer closes (a reset ends it too)."""
    out = b""
    try:
        while chunk := s.recv(1 << 16):
            out += chunk
    except (ConnectionResetError, ssl.SSLError, TimeoutError):
        pass
    return out


def http_request(cluster: LocalCluster, path: str, body: bytes, token: str | None) -> tuple[int, dict]:
    """One POST with a Content-Length; (status, JSON body)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    with tls_socket(cluster) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: kvrelay\r\nContent-Type: application/json\r\n{auth}"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        resp = read_all(s)
    head, _, data = resp.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(data)


def chunked_upload(cluster: LocalCluster, total: int, token: str | None) -> tuple[bytes, int]:
    """Sends a chunked body of ``total`` bytes (or until the server stops reading); (response, bytes sent)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s = tls_socket(cluster, timeout_s=10)
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: kvrelay\r\nContent-Type: application/json\r\n{auth}"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    piece = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
    sent = 0
    try:
        s.sendall(b'5\r\n{"a":\r\n')
        while sent < total:
            s.sendall(piece)
            sent += 1 << 20
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
        pass
    resp = read_all(s)
    s.close()
    return resp, sent


def half_open(cluster: LocalCluster, n: int, source: str = "127.0.0.2") -> list[socket.socket]:
    """``n`` connections from ``source`` that never finish a request: half
    stop after the TLS handshake and half a request head, half never start TLS."""
    host, _, port = cluster.http_address.rpartition(":")
    ctx = ssl.create_default_context(cafile=str(cluster.ca_file))
    conns = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
        if i % 2:
            s = ctx.wrap_socket(s, server_hostname=host)
            s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: kvrelay\r\n".encode())
        conns.append(s)
    return conns


def closed_within(conns: list[socket.socket], limit_s: float) -> tuple[int, float]:
    """How many of ``conns`` the server closed within ``limit_s``, and when the last one closed."""
    t0, closed, last = time.monotonic(), 0, 0.0
    for s in conns:
        s.settimeout(max(0.05, t0 + limit_s - time.monotonic()))
        try:
            gone = s.recv(1) == b""
        except (ConnectionResetError, ssl.SSLError):
            gone = True
        except OSError:  # our timeout: still open
            gone = False
        if gone:
            closed, last = closed + 1, time.monotonic() - t0
        s.close()
    return closed, last


@dataclass(slots=True)
class HeartbeatWatch:
    """ListWorkers every 100 ms from a thread: its latency, the oldest heartbeat, whether all stayed healthy."""

    cluster: LocalCluster
    samples: list[tuple[float, float, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with self.cluster.channel(operator=True) as ch:
            stub = wgrpc.RegistryStub(ch)
            while not self.stop.is_set():
                t = time.monotonic()
                ws = stub.ListWorkers(wpb.ListWorkersRequest(), timeout=30).workers
                self.samples.append((time.monotonic() - t, max(w.last_heartbeat_age_s for w in ws),
                                     all(w.healthy for w in ws)))
                time.sleep(0.1)

    def max_rpc_s(self) -> float:
        return max(s[0] for s in self.samples)

    def max_heartbeat_age_s(self) -> float:
        return max(s[1] for s in self.samples)

    def all_healthy(self) -> bool:
        return bool(self.samples) and all(s[2] for s in self.samples)


def flood(cluster: LocalCluster, prompt_bytes: int, n: int, token: str) -> HeartbeatWatch:
    """``n`` prompts of ``prompt_bytes`` at once over gRPC and ``n`` over HTTP
    (as the tenant of ``token``), while heartbeats are watched."""
    watch = HeartbeatWatch(cluster)
    watcher = threading.Thread(target=watch.run)
    watcher.start()
    big = ipb.GenerateRequest(prompt="w" * prompt_bytes, max_tokens=2)
    body = json.dumps({"messages": [{"role": "user", "content": "w" * prompt_bytes}], "max_tokens": 2}).encode()
    try:
        with cluster.dialer(token).sync(cluster.router_address) as ch, concurrent.futures.ThreadPoolExecutor(n) as pool:
            stub = igrpc.InferenceStub(ch)

            def one(_) -> None:
                try:
                    list(stub.Generate(big, timeout=60))
                except grpc.RpcError:
                    pass

            list(pool.map(one, range(n)))
            list(pool.map(lambda _: http_request(cluster, CHAT, body, token), range(n)))
    finally:
        watch.stop.set()
        watcher.join()
    return watch


@dataclass(slots=True)
class ProbeFigures:
    grpc_5mb_refused_s: float
    http_5mb_refused_s: float
    upload_200mb_status: int
    upload_200mb_sent_mib: int
    upload_200mb_rss_growth_mib: float
    half_open_closed: int
    half_open_last_closed_s: float
    flood_max_heartbeat_age_s: float
    flood_max_list_workers_s: float

    def to_json(self) -> dict:
        return asdict(self)


def _timed_refusal(cluster: LocalCluster) -> tuple[float, float]:
    with cluster.channel() as ch:
        stub = igrpc.InferenceStub(ch)
        t0 = time.monotonic()
        try:
            list(stub.Generate(ipb.GenerateRequest(prompt="w" * FIVE_MB, max_tokens=2), timeout=30))
        except grpc.RpcError:
            pass
        grpc_s = time.monotonic() - t0
    body = json.dumps({"messages": [{"role": "user", "content": "w" * FIVE_MB}]}).encode()
    t0 = time.monotonic()
    http_request(cluster, CHAT, body, cluster.client_token or None)
    return grpc_s, time.monotonic() - t0


def run_probes(cluster: LocalCluster, header_timeout_s: float) -> ProbeFigures:
    """Every probe once, against a running cluster with the HTTP API on."""
    grpc_s, http_s = _timed_refusal(cluster)
    with RssPeak(router_pid(cluster)) as rss:
        resp, sent = chunked_upload(cluster, 200 << 20, cluster.client_token or None)
    status = int(resp.split()[1]) if resp.startswith(b"HTTP/") else 0
    conns = half_open(cluster, 500)
    closed, last = closed_within(conns, header_timeout_s + 20)
    watch = flood(cluster, FIVE_MB, 10, cluster.client_token)
    return ProbeFigures(round(grpc_s, 4), round(http_s, 4), status, sent >> 20, round(rss.growth / 2**20, 1),
                        closed, round(last, 2), round(watch.max_heartbeat_age_s(), 2), round(watch.max_rpc_s(), 3))
