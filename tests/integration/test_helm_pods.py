"""The one-site chart example's pods, run as real processes on loopback:
every container's command line exactly as rendered (init containers first),
with the rendered ConfigMap as the config, and only what a kubelet supplies
replaced (mount paths by folders here, $(POD_NAME) and $(POD_IP), the
Service name by 127.0.0.1, each pod's fixed ports by free ones; and the
policy round_robin, so the KV crosses between the pods whatever their
measured speeds). The CA is made as the chart's README says (kvrelay pki
init), and cert-manager's part is played by `kvrelay pki issue` with that
CA, issuing exactly what the rendered Certificate (the router) and csi
volume attributes (each worker pod) ask for. Checks: each pod's certificate
is the one the chart asked cert-manager for; the probes answer; a tenant's
request is served through the router's Service name; `kvrelay scale` is
refused saying what to change."""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.launch import helm as chart
from kvrelay.runtime.pki import identity_of, load_cert, read_pem
from kvrelay.runtime.rpc import Dialer
from kvrelay.runtime.tls import TLSMaterial
from kvrelay.v1 import admin_pb2 as apb
from kvrelay.v1 import admin_pb2_grpc as agrpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.probes import probe

pytestmark = pytest.mark.model
BIN = Path(sys.executable).parent
TOKEN = "test"
"""The one-site example's tenant token (its token_sha256 is SHA-256 of "test")."""
DEADLINE_S = 180.0


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the pods bind theirs seconds after
    this choice (init containers run first), and an outgoing connection of any process
    may take a free ephemeral port meanwhile, but never one below the range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


class Pods:
    """The rendered Deployments' pods as processes; mounts become folders under ``root``."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.procs = root, model, []
        self.docs = [d for d in yaml.safe_load_all((chart.EXAMPLES / "one-site" / "rendered.yaml").read_text()) if d]
        subprocess.run([str(BIN / "kvrelay"), "pki", "init", str(root / "pki")], check=True, capture_output=True)
        (root / "ca").mkdir()
        shutil.copy(root / "pki" / "ca.pem", root / "ca" / "ca.crt")
        (root / "kv").mkdir()
        (root / "kv" / "secret").write_text(os.urandom(32).hex())
        self.router_ports = {"grpc": free_port(), "internal": free_port(), "http": free_port()}

    def mounts(self, pod: str) -> dict[str, str]:
        """Paths in the pod -> folders here (the pod's own tls, tmp and state)."""
        own = self.root / pod
        return {"/etc/kvrelay/config": str(own / "config"), "/etc/kvrelay/ca": str(self.root / "ca"),
                "/etc/kvrelay/kv": str(self.root / "kv"),
                "/var/run/kvrelay/tls": str(own / "tls"), "/var/lib/kvrelay": str(own / "state"),
                "/opt/kvrelay/models/SmolLM2-135M-Instruct": str(self.model), "/tmp": str(own / "tmp")}

    def remap(self, text: str, pod: str) -> str:
        """``text`` with every path inside the pod replaced by its folder here (one pass)."""
        mounts = self.mounts(pod)
        pattern = "|".join(re.escape(k) for k in sorted(mounts, key=len, reverse=True))
        return re.sub(f"({pattern})(?=/|\\s|$)", lambda m: mounts[m.group(1)], text, flags=re.M)

    def config_for(self, pod: str, health: int, metrics: int) -> None:
        """The ConfigMap's cluster.yaml, with the pod's mounts and its own free ports."""
        cm = next(d for d in self.docs if d["kind"] == "ConfigMap")
        cfg = yaml.safe_load(self.remap(cm["data"]["cluster.yaml"], pod))
        cfg["router"] |= {"port": self.router_ports["grpc"], "internal_port": self.router_ports["internal"],
                          "http_port": self.router_ports["http"]}
        # cost_model may rightly prefill a short prompt on an idle decode pod when the two
        # pods' measured speeds differ (they do on a busy machine); round_robin always
        # sends it through the prefill pod, so the KV crosses between pods every time
        cfg["router"].setdefault("placement", {})["policy"] = "round_robin"
        cfg["health"] |= {"router_port": health, "worker_port": health}
        cfg["telemetry"] |= {"router_metrics_port": metrics, "worker_metrics_port": metrics}
        (self.root / pod / "config").mkdir(parents=True)
        (self.root / pod / "config" / "cluster.yaml").write_text(yaml.safe_dump(cfg))
        for sub in ("tls", "state", "tmp"):
            (self.root / pod / sub).mkdir(exist_ok=True)

    def argv(self, container: dict, pod: str) -> list[str]:
        argv = container.get("command", []) + container.get("args", [])
        out = []
        for a in argv:
            a = self.remap(a, pod).replace("$(POD_NAME)", pod).replace("$(POD_IP)", "127.0.0.1")
            out.append(a.replace("kvrelay-router:50052", f"127.0.0.1:{self.router_ports['internal']}"))
        head = {"python": str(sys.executable), "kvrelay": str(BIN / "kvrelay")}
        return [head.get(out[0], out[0]), *out[1:]]

    def certificate_request(self, spec: dict, pod: str) -> tuple[str, list[str], int]:
        """What the pod's tls volume asks cert-manager for: (URI SAN, DNS names, hours)."""
        tls = next(v for v in spec["volumes"] if v["name"] == "tls")
        if "csi" in tls:  # a worker: cert-manager's csi-driver, with the pod's name filled in
            attrs = {k.removeprefix("csi.cert-manager.io/"): v.replace("${POD_NAME}", pod)
                     for k, v in tls["csi"]["volumeAttributes"].items()}
            assert (attrs["certificate-file"], attrs["privatekey-file"]) == ("tls.pem", "tls.key")
            return attrs["uri-sans"], attrs["dns-names"].split(","), int(attrs["duration"].removesuffix("h"))
        # the router: the Secret of a Certificate resource, its keys mounted as tls.pem and tls.key
        assert tls["secret"]["items"] == [{"key": "tls.crt", "path": "tls.pem"}, {"key": "tls.key", "path": "tls.key"}]
        cert = next(d for d in self.docs if d["kind"] == "Certificate"
                    and d["spec"]["secretName"] == tls["secret"]["secretName"])
        (uri,) = cert["spec"]["uris"]
        return uri, cert["spec"]["dnsNames"], int(cert["spec"]["duration"].removesuffix("h"))

    def issue_as_cert_manager(self, spec: dict, pod: str) -> None:
        """Issues the certificate the pod's tls volume asks for into its tls folder."""
        uri, hosts, hours = self.certificate_request(spec, pod)
        site, role, name = uri.removeprefix("kvrelay://").split("/")
        subprocess.run([str(BIN / "kvrelay"), "pki", "issue", "--role", role, "--site", site, "--name", name,
                        "--ca-dir", str(self.root / "pki"), "--out", str(self.root / pod / "tls"), "--stem", "tls",
                        "--days", str(hours / 24), *(f"--host={h}" for h in hosts)],
                       check=True, capture_output=True, timeout=120)

    def start(self, deployment: str, pod: str) -> int:
        """Runs the pod's init containers, then its main container; returns its probe port."""
        doc = next(d for d in self.docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment)
        spec = doc["spec"]["template"]["spec"]
        health = free_port()
        self.config_for(pod, health, free_port())
        env = {**os.environ, "POD_NAME": pod, "POD_IP": "127.0.0.1", "HOME": str(self.root / pod / "tmp"),
               "UCX_MODULES": "^ib"}
        self.issue_as_cert_manager(spec, pod)
        for init in spec.get("initContainers", []):
            subprocess.run(self.argv(init, pod), check=True, capture_output=True, env=env, timeout=120)
        main = spec["containers"][0]
        log = open(self.root / f"{pod}.log", "w")  # noqa: SIM115 (the pod's output, as long as it runs)
        self.procs.append(subprocess.Popen(self.argv(main, pod), env=env, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=self.root / pod / "tmp"))
        return health

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_ready(port: int, what: str, pods: Pods) -> None:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if probe(port, "/readyz")[0] == 200:
            return
        dead = [p for p in pods.procs if p.poll() is not None]
        assert not dead, f"{what}: a pod exited: {dead[0].args[:3]} (logs in {pods.root})"
        time.sleep(0.5)
    raise AssertionError(f"{what} not ready within {DEADLINE_S:g} s: {probe(port, '/readyz')}")


@pytest.fixture(scope="module")
def pods(tmp_path_factory, plumbing_model):
    p = Pods(tmp_path_factory.mktemp("pods"), Path(plumbing_model))
    try:
        router = p.start("kvrelay-router", "kvrelay-router-6c9d7f8b4-abcde")
        wait_ready(router, "router", p)
        p.health = {"router": router}
        for role in ("prefill", "decode"):
            p.health[role] = p.start(f"kvrelay-local-{role}", f"kvrelay-local-{role}-5f7b9c8d6-{role[:5]}")
        for role in ("prefill", "decode"):
            wait_ready(p.health[role], role, p)
        yield p
    finally:
        p.stop()


def test_the_pods_have_the_identities_the_chart_asked_for_and_no_ca_key(pods: Pods):
    for pod in pods.docs:
        if pod["kind"] == "Deployment":
            assert "initContainers" not in pod["spec"]["template"]["spec"]  # no pod issues with the CA key
    assert not any(p.name == "ca.key" for p in pods.root.rglob("*") if "pki" not in p.parts)
    for pod, want in (("kvrelay-router-6c9d7f8b4-abcde", "kvrelay://local/router/0"),
                      ("kvrelay-local-decode-5f7b9c8d6-decod", "kvrelay://local/decode/kvrelay-local-decode-5f7b9c8d6-decod")):
        cert = load_cert(read_pem(str(pods.root / pod / "tls" / "tls.pem"), "cert"), "cert")
        assert identity_of(cert).uri == want
        assert oct((pods.root / pod / "tls" / "tls.key").stat().st_mode & 0o777) == "0o600"


def test_probes_answer(pods: Pods):
    for role, port in pods.health.items():
        for path in ("/livez", "/readyz"):  # a busy machine may delay one answer past the 2 s loop deadline
            end, got = time.monotonic() + 60, None
            while time.monotonic() < end and (got := probe(port, path)) != (200, {"status": "ok"}):
                time.sleep(1)
            assert got == (200, {"status": "ok"}), (role, path)


def _dialer(pods: Pods, **kw) -> Dialer:
    return Dialer(TLSMaterial((pods.root / "ca" / "ca.crt").read_bytes(), **kw))


def test_a_tenant_is_served_through_the_service_name(pods: Pods):
    dialer = _dialer(pods).with_token(TOKEN)
    with dialer.sync(f"127.0.0.1:{pods.router_ports['grpc']}", server_name="kvrelay-router.kvrelay.svc") as ch:
        stub = igrpc.InferenceStub(ch)
        prompt = "Name three colours of the rainbow and say which one you like best, in one sentence. " * 3
        msgs = list(stub.Generate(ipb.GenerateRequest(prompt=prompt, max_tokens=8), timeout=120))
    tokens = [t for m in msgs for t in m.token_ids]
    assert 0 < len(tokens) <= 8
    placed = msgs[-1].finish.placement  # disaggregated: the KV crossed from one pod to the other
    assert placed.decode_worker == "local/decode/kvrelay-local-decode-5f7b9c8d6-decod"
    assert placed.prefill_worker == "local/prefill/kvrelay-local-prefill-5f7b9c8d6-prefi"
    assert not placed.colocated and placed.kv_bytes > 0


def test_kvrelay_scale_is_refused_saying_what_to_change(pods: Pods):
    subprocess.run([str(BIN / "kvrelay"), "pki", "issue", "--role", "operator", "--site", "local", "--name", "noc",
                    "--ca-dir", str(pods.root / "pki"), "--out", str(pods.root / "op"), "--stem", "op"],
                   check=True, capture_output=True)
    tls = TLSMaterial((pods.root / "ca" / "ca.crt").read_bytes(), (pods.root / "op" / "op.pem").read_bytes(),
                      (pods.root / "op" / "op.key").read_bytes())
    with Dialer(tls).sync(f"127.0.0.1:{pods.router_ports['internal']}", server_name="router.kvrelay") as ch:
        stub = agrpc.AdminStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Scale(apb.ScaleRequest(site="local", role="decode", replicas=3), timeout=30)
        pools = stub.ListPools(apb.ListPoolsRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "helm upgrade" in err.value.details() and "kubectl scale" in err.value.details()
    decode = next(p for p in pools.pools if p.role == "decode")
    assert (decode.desired, decode.active) == (1, 1)
