"""WAN emulation between cities (``kvrelay cities up|down|status|check``).

Every site of a config gets its own network namespace; the sites are joined
by emulated long-distance links with the configured RTT and rate, so that
the kernel's TCP between them meets real bandwidth-delay effects::

    root namespace: bridge <prefix>-br, gateway x.y.0.1/24  (router, clients)
       |  veth per site: "mgmt" x.y.0.(10+i)/24 in site i     (control plane, no delay)
    site i namespace: site address x.y.(1+i).1/32 on lo      (workers bind it)
       |  per link (i, j): TUN "wan<j>" in i <-> TUN "wan<i>" in j
       |     rate: tbf on each TUN's egress; delay: launch.delayline (user space)
    site j namespace: route x.y.(1+j).0/24 dev wan<i> ...

Traffic between sites (KV transfers and the decode->prefill calls) takes
the emulated links; the router and clients in the root namespace reach each
site over its management veth without added delay (the router stands in for
a control plane that is not on the KV data path). Sites without a link
cannot reach each other at all.

Everything is created with names from ``prefix`` and addresses from
``subnet``; nothing else on the machine is touched except that forwarding is
never enabled anywhere (no namespace routes between others). Needs root
(CAP_NET_ADMIN); ``up`` checks and says so. State lives in a JSON file so
``down`` and ``kvrelay serve --cities`` find what ``up`` made.

What runs as root: ``up``/``down`` (namespaces, bridge, veths, TUN devices,
tc, sysctls), the delay lines ``up`` starts (they create the TUN devices),
``cities check`` (linkprobe enters namespaces with setns), and the
``ip netns exec`` that starts each worker. What does not: the workers
themselves. :meth:`CitiesState.exec_prefix` has ``ip netns exec`` exec
util-linux's ``setpriv``, which drops to the user who ran sudo (or, when
really root, to uid 0 without any capability) and execs the worker in place
(launch/privileges.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.launch.privileges import (
    PrivilegeError,
    WorkerDrop,
    share_with_workers,
    unreadable,
    unwritable,
    worker_drop,
)

if TYPE_CHECKING:
    from kvrelay.runtime.config import ClusterConfig

DEFAULT_STATE_DIR = Path("/run/kvrelay")
DEFAULT_SUBNET = "10.213.0.0/16"
DEFAULT_PREFIX = "kvr"
WAN_MTU = 9000
"""Research networks carry jumbo frames end to end; it also keeps the user-space
delay line's packet rate (and CPU) low enough for 1 Gbit/s on a small machine."""

NS_TCP_MEM = "4096 131072 134217728"
"""tcp_rmem/tcp_wmem inside each site namespace: a WAN-tuned host (ESnet
fasterdata), so a single stream can fill a long fat link."""


class CitiesError(RuntimeError):
    """The emulation could not be set up or used; the message says why."""


@dataclass(slots=True)
class SiteNet:
    name: str
    netns: str
    mgmt_addr: str
    """This site's address on the management bridge."""
    site_addr: str
    """Address the site's workers bind; reached from other sites over the links."""
    site_net: str
    veth_root: str


@dataclass(slots=True)
class LinkNet:
    a: str
    b: str
    dev_a: str
    """TUN device name inside site a's namespace (leads to b)."""
    dev_b: str
    rtt_ms: float
    gbps: float
    pid: int = 0
    """The delay line's process id (0 until started)."""
    cut: bool = False
    """True while ``kvrelay cities cut`` has the link dropping every packet."""


@dataclass(slots=True)
class CitiesState:
    prefix: str
    subnet: str
    bridge: str
    gateway: str
    """The root namespace's address on the bridge: where the router listens."""
    sites: list[SiteNet] = field(default_factory=list)
    links: list[LinkNet] = field(default_factory=list)
    log_dir: str = ""
    drop: WorkerDrop | None = field(default=None, repr=False, compare=False)
    """How workers give up root (launch/privileges.py). Not saved: it depends on
    who runs ``serve``, not on who ran ``up``; None until first needed, then
    computed once from the environment (or set by the caller beforehand)."""

    def site(self, name: str) -> SiteNet:
        for s in self.sites:
            if s.name == name:
                return s
        raise CitiesError(f"site {name!r} is not part of the emulated cities ({', '.join(s.name for s in self.sites)})")

    def link(self, a: str, b: str) -> LinkNet:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise CitiesError(f"no emulated link between {a!r} and {b!r}")

    def worker_drop(self) -> WorkerDrop:
        """How workers give up root; computed once, from this process's environment
        (SUDO_UID/SUDO_GID), unless the caller set ``drop``. CitiesError without setpriv."""
        if self.drop is None:
            try:
                self.drop = worker_drop(os.environ)  # the one place the launcher's environment is read for it
            except PrivilegeError as exc:
                raise CitiesError(f"workers under --cities must not run as root: {exc}") from None
        return self.drop

    def exec_prefix(self, site: str) -> list[str]:
        """Command prefix that runs a program inside ``site``'s namespace,
        unprivileged: ``ip netns exec <ns>`` (root) execs ``setpriv``, which
        drops root and execs the program; the pid stays the same throughout."""
        return ["ip", "netns", "exec", self.site(site).netns, *self.worker_drop().prefix]

    def share_with_workers(self, path: Path) -> None:
        """Makes ``path`` (a folder or file the root launcher made for the
        workers, e.g. the config it writes) readable by the workers' group;
        nothing to do when workers keep uid 0."""
        share_with_workers(path, self.worker_drop())

    def check_router_writes(self, paths: list[str]) -> None:
        """CitiesError naming the records (``paths``) an unprivileged router
        could not write; nothing to check when it keeps uid 0 (root's files are its own)."""
        drop = self.worker_drop()
        if drop.keeps_root_uid:
            return
        blocked = unwritable(drop, sys.executable, paths)
        if blocked:
            raise CitiesError(f"the router runs as uid {drop.uid} (not root) under --cities and cannot write "
                              f"{', '.join(blocked)}: keep its records (router.records.*) where that user can "
                              "write, e.g. --cache-dir in your home, files and folders of that user's own")

    def check_worker_access(self, paths: list[Path | str]) -> None:
        """CitiesError naming what of ``paths`` (and the interpreter) the
        unprivileged workers could not read, with what to do about it."""
        drop = self.worker_drop()
        missing = unreadable(drop, sys.executable, paths)
        if missing:
            raise CitiesError(f"workers run as uid {drop.uid} (not root) and cannot read "
                              f"{', '.join(missing)}: keep the venv, model and config where that user "
                              "can read them (e.g. --cache-dir in your home, not /root)")

    def matches(self, cfg: ClusterConfig) -> str | None:
        """None if this emulation fits ``cfg`` (same sites, links, RTTs, rates), else why not."""
        want_sites = sorted(s.name for s in cfg.sites)
        have_sites = sorted(s.name for s in self.sites)
        if want_sites != have_sites:
            return f"the config's sites {want_sites} differ from the emulated ones {have_sites}"
        want = {(frozenset(lk.between), lk.rtt_ms, lk.gbps) for lk in cfg.links}
        have = {(frozenset((lk.a, lk.b)), lk.rtt_ms, lk.gbps) for lk in self.links}
        if want != have:
            return "the config's links differ from the emulated ones (run kvrelay cities down, then up again)"
        return None


def plan(cfg: ClusterConfig, subnet: str = DEFAULT_SUBNET, prefix: str = DEFAULT_PREFIX) -> CitiesState:
    """Names and addresses for ``cfg``'s sites and links (no side effects)."""
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise CitiesError(f"--subnet {subnet!r}: {exc}") from None
    if net.version != 4 or net.prefixlen > 16:
        raise CitiesError(f"--subnet {subnet!r}: need an IPv4 network of /16 or larger")
    if not prefix.isalnum() or not 1 <= len(prefix) <= 5:
        raise CitiesError(f"prefix {prefix!r}: 1-5 letters or digits (it goes into interface names)")
    if len(cfg.sites) > 200:
        raise CitiesError(f"{len(cfg.sites)} sites: at most 200 can be emulated")
    base = int(net.network_address)
    addr = lambda third, fourth: str(ipaddress.IPv4Address(base + (third << 8) + fourth))  # noqa: E731
    st = CitiesState(prefix, str(net), f"{prefix}-br", addr(0, 1))
    index = {}
    for i, s in enumerate(cfg.sites):
        index[s.name] = i
        st.sites.append(SiteNet(s.name, f"{prefix}-{s.name}", addr(0, 10 + i), addr(1 + i, 1),
                                f"{addr(1 + i, 0)}/24", f"{prefix}-v{i}"))
    for lk in cfg.links:
        a, b = lk.between
        st.links.append(LinkNet(a, b, f"wan{index[b]}", f"wan{index[a]}", lk.rtt_ms, lk.gbps))
    return st


def _run(cmd: list[str], what: str) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise CitiesError(f"{what}: {cmd[0]!r} is not installed (Debian: apt-get install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise CitiesError(f"{what}: {' '.join(cmd)} did not finish in 30 s") from None
    if res.returncode != 0:
        raise CitiesError(f"{what}: {' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def _ns(netns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", netns, *cmd]


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / "cities.json"


def load_state(state_dir: Path = DEFAULT_STATE_DIR) -> CitiesState | None:
    """The emulation ``up`` made, or None when none is up."""
    p = state_path(state_dir)
    if not p.exists():
        return None
    try:
        raw = json.loads(p.read_text())
        st = CitiesState(**{k: v for k, v in raw.items() if k not in ("sites", "links", "drop")})
        st.sites = [SiteNet(**s) for s in raw["sites"]]
        st.links = [LinkNet(**lk) for lk in raw["links"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise CitiesError(f"{p}: unreadable emulation state ({exc}); remove it after checking "
                          "`ip netns list`") from None
    return st


def _save(st: CitiesState, state_dir: Path) -> None:
    p = state_path(state_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    saved = {k: v for k, v in asdict(st).items() if k != "drop"}  # whom serve drops to is not up's business
    tmp.write_text(json.dumps(saved, indent=2))
    tmp.rename(p)


def check_privileges() -> None:
    """Raises CitiesError unless this process may create namespaces and TUN devices."""
    if os.geteuid() != 0:
        raise CitiesError("emulating cities needs root (network namespaces, veth, TUN and tc): "
                          "run it as root, e.g. sudo kvrelay cities up --config FILE")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise CitiesError(f"{tool!r} is not installed (Debian: apt-get install iproute2)")
    if not Path("/dev/net/tun").exists():
        raise CitiesError("/dev/net/tun is missing: this kernel or container offers no TUN devices")


def tbf_args(gbps: float, rtt_ms: float, mtu: int = WAN_MTU) -> list[str]:
    """tbf parameters for a link: the rate, a burst of ~1 ms (at least a few
    packets) and a queue of one bandwidth-delay product (at least 256 KiB)."""
    rate_bps = gbps * 1e9
    burst = max(4 * mtu, int(rate_bps / 8 / 1000))
    limit = max(256 << 10, int(rate_bps / 8 * rtt_ms / 1000))
    return ["rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def _start_delay_line(st: CitiesState, link: LinkNet, log_dir: Path) -> tuple[int, str, str]:
    """Starts the delay line for ``link`` (detached: it outlives this command);
    returns its pid and the root-namespace names of its two TUN devices."""
    i = [s.name for s in st.sites].index(link.a)
    j = [s.name for s in st.sites].index(link.b)
    tmp_a, tmp_b = f"{st.prefix}-t{i}x{j}", f"{st.prefix}-t{j}x{i}"
    log = open(log_dir / f"link-{link.a}-{link.b}.log", "ab")  # noqa: SIM115 (the child's stderr; closed below)
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.launch.delayline", "--dev-a", tmp_a, "--dev-b", tmp_b,
                             "--delay-ms", str(link.rtt_ms / 2), "--mtu", str(WAN_MTU)],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    log.close()
    if proc.stdout is None:  # stdout=PIPE
        raise CitiesError(f"the delay line for {link.a}-{link.b} has no stdout")
    line = proc.stdout.readline()  # READY, or EOF if it failed
    proc.stdout.close()
    if line.strip() != "READY":
        proc.wait(5)
        raise CitiesError(f"the delay line for {link.a}-{link.b} did not start "
                          f"(see {log_dir / f'link-{link.a}-{link.b}.log'})")
    return proc.pid, tmp_a, tmp_b


def up(cfg: ClusterConfig, state_dir: Path = DEFAULT_STATE_DIR, subnet: str = DEFAULT_SUBNET,
       prefix: str = DEFAULT_PREFIX) -> CitiesState:
    """Creates the namespaces, bridge, veths, TUN links, tbf and routes for
    ``cfg``; on any failure removes what it made and raises CitiesError."""
    check_privileges()
    if load_state(state_dir) is not None:
        raise CitiesError(f"cities are already up ({state_path(state_dir)}); run kvrelay cities down first")
    st = plan(cfg, subnet, prefix)
    existing = _run(["ip", "netns", "list"], "listing namespaces")
    clash = [s.netns for s in st.sites if s.netns in existing.split()]
    if clash:
        raise CitiesError(f"network namespace {clash[0]!r} already exists; remove it or choose another prefix")
    log_dir = Path(state_dir) / f"{prefix}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    st.log_dir = str(log_dir)
    _save(st, state_dir)  # from here on, `down` can clean up whatever exists
    try:
        _build(st, log_dir, state_dir)
    except BaseException:
        down(state_dir)
        raise
    return st


def _build(st: CitiesState, log_dir: Path, state_dir: Path) -> None:
    _run(["ip", "link", "add", st.bridge, "type", "bridge"], "creating the bridge")
    _run(["ip", "addr", "add", f"{st.gateway}/24", "dev", st.bridge], "addressing the bridge")
    _run(["ip", "link", "set", st.bridge, "up"], "bringing the bridge up")
    for s in st.sites:
        _run(["ip", "netns", "add", s.netns], f"creating namespace for {s.name}")
        _run(_ns(s.netns, "ip", "link", "set", "lo", "up"), f"{s.name}: loopback")
        _run(_ns(s.netns, "ip", "addr", "add", f"{s.site_addr}/32", "dev", "lo"), f"{s.name}: site address")
        _run(["ip", "link", "add", s.veth_root, "type", "veth", "peer", "name", "mgmt", "netns", s.netns],
             f"{s.name}: management veth")
        _run(["ip", "link", "set", s.veth_root, "master", st.bridge, "up"], f"{s.name}: veth on the bridge")
        _run(_ns(s.netns, "ip", "addr", "add", f"{s.mgmt_addr}/24", "dev", "mgmt"), f"{s.name}: mgmt address")
        _run(_ns(s.netns, "ip", "link", "set", "mgmt", "up"), f"{s.name}: mgmt up")
        _run(["ip", "route", "add", s.site_net, "via", s.mgmt_addr], f"{s.name}: route from the root namespace")
        for knob in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
            _run(_ns(s.netns, "sysctl", "-q", "-w", f"{knob}={NS_TCP_MEM}"), f"{s.name}: {knob}")
    for link in st.links:
        link.pid, tmp_a, tmp_b = _start_delay_line(st, link, log_dir)
        _save(st, state_dir)
        for site, tmp, dev, peer in ((link.a, tmp_a, link.dev_a, link.b), (link.b, tmp_b, link.dev_b, link.a)):
            s, p = st.site(site), st.site(peer)
            what = f"link {link.a}-{link.b} at {site}"
            _run(["ip", "link", "set", tmp, "netns", s.netns], what)
            _run(_ns(s.netns, "ip", "link", "set", tmp, "name", dev, "mtu", str(WAN_MTU), "up"), what)
            _run(_ns(s.netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                     *tbf_args(link.gbps, link.rtt_ms)), what + " (tbf)")
            _run(_ns(s.netns, "ip", "route", "add", p.site_net, "dev", dev, "src", s.site_addr), what + " (route)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def link_signal(state_dir: Path, a: str, b: str, cut: bool) -> None:
    """Cuts (every packet dropped) or restores the emulated link between two sites."""
    st = load_state(state_dir)
    if st is None:
        raise CitiesError("no cities are up")
    link = st.link(a, b)
    if not link.pid or not _pid_alive(link.pid):
        raise CitiesError(f"the delay line of link {a}-{b} is not running")
    os.kill(link.pid, signal.SIGUSR1 if cut else signal.SIGUSR2)
    link.cut = cut
    _save(st, state_dir)


def set_link_rate(state_dir: Path, a: str, b: str, gbps: float) -> None:
    """Changes the emulated link between two sites to ``gbps`` (both directions; its tbf queue is
    re-sized for the new rate), as a WAN whose capacity changes under load: connections stay up."""
    if not 0 < gbps <= 1000:
        raise CitiesError(f"a link's rate must be in (0, 1000] Gbit/s, got {gbps}")
    st = load_state(state_dir)
    if st is None:
        raise CitiesError("no cities are up")
    link = st.link(a, b)
    for site, dev in ((link.a, link.dev_a), (link.b, link.dev_b)):
        _run(_ns(st.site(site).netns, "tc", "qdisc", "change", "dev", dev, "root", "tbf",
                 *tbf_args(gbps, link.rtt_ms)), f"link {link.a}-{link.b} at {site} (tbf)")
    link.gbps = gbps
    _save(st, state_dir)


def link_alive(link: LinkNet) -> bool:
    """Whether the link's delay line still runs (the link is gone when it does not)."""
    return bool(link.pid) and _pid_alive(link.pid)


def down(state_dir: Path = DEFAULT_STATE_DIR, timeout_s: float = 10.0) -> list[str]:
    """Stops the delay lines and deletes every namespace, veth and the bridge
    that ``up`` made; returns what it could not remove (empty when clean).
    Idempotent: what is already gone (an earlier ``down``, or a veth that went
    with its namespace meanwhile) counts as removed; any other failure, or a
    device or namespace still there after its removal failed, is a problem."""
    st = load_state(state_dir)
    if st is None:
        return []
    _stop_delay_lines(st.links, timeout_s)
    problems = _remove_namespaces(st) + _remove_devices(st)
    if not problems:
        state_path(state_dir).unlink(missing_ok=True)
    return problems


def _stop_delay_lines(links: list[LinkNet], timeout_s: float) -> None:
    """SIGTERM to every link's delay line; SIGKILL to those still alive after ``timeout_s``."""
    for link in links:
        if link.pid and _pid_alive(link.pid):
            os.kill(link.pid, signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for link in links:
        while link.pid and _pid_alive(link.pid) and time.monotonic() < end:
            try:
                os.waitpid(link.pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            time.sleep(0.05)
        if link.pid and _pid_alive(link.pid):
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(link.pid, signal.SIGKILL)


_GONE = ("Cannot find device", "No such file or directory", "does not exist")
"""What iproute2 says when the thing to delete is not there (any more)."""


def _netns_list() -> list[str]:
    # `ip netns list` prints "name (id: N)" once a namespace has an id
    return [line.split()[0] for line in
            subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.strip()]


def _remove(cmd: list[str], exists, what: str) -> str | None:
    """Runs ``cmd`` to delete ``what``; None when it is gone afterwards (also
    when it was gone already), else the problem."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    err = r.stderr.strip() or r.stdout.strip()
    if any(g in err for g in _GONE) or not exists():
        return None
    return f"{what}: {err}"


def _remove_namespaces(st: CitiesState) -> list[str]:
    """Deletes the sites' namespaces (which deletes their veth ends, TUNs and routes)."""
    existing = _netns_list()
    problems = []
    for s in st.sites:
        if s.netns in existing:
            problem = _remove(["ip", "netns", "delete", s.netns], lambda n=s.netns: n in _netns_list(),
                              f"namespace {s.netns}")
            if problem:
                problems.append(problem)
    return problems


def _remove_devices(st: CitiesState) -> list[str]:
    """Deletes the bridge and the veths' root ends (a veth may vanish on its own
    while its peer's namespace goes away)."""
    problems = []
    for dev in [st.bridge] + [s.veth_root for s in st.sites]:
        path = Path(f"/sys/class/net/{dev}")
        if path.exists():
            problem = _remove(["ip", "link", "del", dev], path.exists, f"device {dev}")
            if problem:
                problems.append(problem)
    return problems
