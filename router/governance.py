"""The data-handling statement: the eight questions an institution asks of an
inference service, answered for each tenant from the live config and state,
never from text written in advance. Institutions file it with their records.

``statement(cfg, state, tenant)`` is a pure function (no I/O, no clock) over
the config and a :class:`DeploymentState` (router/deployment.py; the Admin
API's ``Governance`` takes it from the registry). Its JSON::

    {"generated_at": "...Z", "deployment": {...},
     "tenants": [{"tenant": "lab-qc", "warnings": [...],
                  "answers": [{"question": 1, "title": "...", "answer": "...", "facts": {...}}, ...]}]}

Each answer is a sentence or a few built from the facts beside it. What
kvrelay cannot know (who runs the hardware, who is on call, whether a link
is a private path) is said to be not recorded in the configuration."""

from __future__ import annotations

import dataclasses
import datetime
from enum import IntEnum

from router.auth import ANONYMOUS
from router.deployment import Deployment, DeploymentState, Pool, Reach, deployment_state
from runtime.config import ClusterConfig, is_loopback
from runtime.tenants import TenantSection
from runtime.topology import LOCAL_LINK

__all__ = ["NOT_RECORDED", "DeploymentState", "Question", "UnknownTenant", "deployment_state", "statement"]

NOT_RECORDED = "not recorded in the configuration"
"""The answer to what kvrelay cannot know."""


class Question(IntEnum):
    """The eight questions, numbered as the statement numbers them."""

    OPERATORS = 1
    ACCELERATORS = 2
    JURISDICTIONS = 3
    RETENTION = 4
    ACCESS = 5
    IDENTITY = 6
    RESPONSIBILITY = 7
    PORTABILITY = 8

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES = {
    Question.OPERATORS: "Who operates the model, runtime and control plane?",
    Question.ACCELERATORS: "Are the accelerators shared, reserved or dedicated?",
    Question.JURISDICTIONS: "In which jurisdictions are prompts, outputs, logs and backups processed and stored?",
    Question.RETENTION: "How long is data kept, and can it be used for anything else?",
    Question.ACCESS: "Which users, vendor staff and administrators can access it?",
    Question.IDENTITY: "Can it use institutional or federated identity, private network paths and "
                       "per-organisation access policies?",
    Question.RESPONSIBILITY: "Who is responsible for monitoring, incidents, upgrades and capacity?",
    Question.PORTABILITY: "Can the organisation move its workloads and data elsewhere?",
}


class UnknownTenant(LookupError):
    """The statement was asked for a tenant the config does not have."""

    def __init__(self, tenant: str, known: list[str]) -> None:
        super().__init__(f"no tenant {tenant!r} is configured (tenants: {', '.join(known) or 'none'})")
        self.tenant = tenant


# ------------------------------------------------------------------ helpers
def _names(names, none: str = "none", last: str = "and") -> str:
    """``a, b and c`` (``none`` when empty; ``last`` joins the last two)."""
    names = [str(n) for n in names]
    if not names:
        return none
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _section(value) -> object:
    """A config section as plain data (None stays None): for sections a later config may add."""
    if value is None or not dataclasses.is_dataclass(value):
        return value
    return {k: str(v) if hasattr(v, "value") else v for k, v in dataclasses.asdict(value).items()}


def _section_text(value) -> str:
    """A section from :func:`_section` in a sentence."""
    if isinstance(value, dict):
        return "; ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def _router(d: Deployment) -> dict:
    r = d.cfg.router
    return {"site": r.site, "jurisdiction": d.jurisdiction(r.site), "host": r.host, "loopback_only": is_loopback(r.host),
            "port": r.port, "internal_port": r.internal_port, "http_port": r.http_port}


def _router_where(d: Deployment) -> str:
    r = d.cfg.router
    if r.site is None:
        return f"host {r.host}, at a site the config does not declare (router.site)"
    return f"host {r.host} at {r.site} ({d.jurisdiction(r.site)})"


def _stores(cfg: ClusterConfig) -> dict:
    """The router's files (on its host), None where the config names none."""
    r = cfg.router
    return {"audit_log": r.audit_log, "jobs_db": r.jobs_db, "usage_db": r.usage_db}


_STORE_WORDS = {"audit_log": "the audit log (who, when, where, how much)",
                "jobs_db": "the jobs database (job requests and results)",
                "usage_db": "the usage records (token counts)"}


def _link_text(lk: dict) -> str:
    where = "the network within each site" if lk["link"] == LOCAL_LINK else lk["link"]
    return f"{where} ({'/'.join(lk['transport'])}, {lk['protection']})"


def _operators(cfg: ClusterConfig) -> dict:
    """Who holds operator credentials: token names, and whether the CA's operator certificates count."""
    return {"tokens": [c.name for c in cfg.auth.operators], "certificates_accepted": cfg.tls.enabled,
            "ca": cfg.tls.ca}


def _operators_text(cfg: ClusterConfig) -> str:
    ops = _operators(cfg)
    certs = " and any operator certificate from the cluster CA" if ops["certificates_accepted"] else ""
    return f"the holders of operator tokens ({_names(ops['tokens'])}){certs}"


def _pool_text(p: Pool) -> str:
    live = p.facts()["live"]["healthy"]
    return f"{p.name} ({p.device}, {live} live of {p.desired})"


def _answer(q: Question, text: str, facts: dict) -> dict:
    return {"question": int(q), "title": q.title, "answer": text, "facts": facts}


# ------------------------------------------------------------------ the eight answers
def operators(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(1) The model, the runtime, the control plane and who administers them."""
    cfg, st = d.cfg, d.state
    models = sorted({w.model for w in st.workers if w.model})
    path = st.model_path or cfg.model.path
    sites = [f"{s} ({j})" for s, j in r.sites()]
    facts = {"model": {"names": models, "path": path, "embedded_default": path is None, "dtype": cfg.model.dtype},
             "runtime": {"software": "kvrelay", "version": st.version}, "control_plane": _router(d),
             "operator_credentials": _operators(cfg), "sites": sites, "site_and_hardware_operator": NOT_RECORDED}
    checkpoint = "the embedded default checkpoint" if path is None else f"checkpoint {path}"
    text = (f"The model {_names(models, 'not yet reported by a worker')} ({checkpoint}) is served by kvrelay "
            f"{st.version}. The control plane is the router on {_router_where(d)}, administered by "
            f"{_operators_text(cfg)}. Which institution operates the sites ({_names(sites)}) and their hardware "
            f"is {NOT_RECORDED}.")
    return _answer(Question.OPERATORS, text, facts)


def accelerators(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(2) The pools its requests may use: shared (with whom) or dedicated."""
    pools = [p.facts() | {"other_tenants": [n for n in d.users_of(p) if n != t.name]} for p in r.pools]
    shared = [p for p in r.pools if not p.dedicated_to]
    dedicated = [p for p in r.pools if p.dedicated_to]
    facts = {"pools": pools, "closed_to_it": [p.facts() for p in r.closed],
             "reservations": "none beyond dedicated pools", "other_workloads_on_the_hosts": NOT_RECORDED}
    parts = []
    if shared:
        others = sorted({n for p in shared for n in d.users_of(p)} - {t.name})
        parts.append(f"shared by every tenant: {_names(_pool_text(p) for p in shared)} "
                     f"(other tenants that may use them: {_names(others)})")
    for p in dedicated:
        whom = "this tenant only" if p.dedicated_to == [t.name] else f"tenants {_names(p.dedicated_to)}"
        parts.append(f"dedicated to {whom}: {_pool_text(p)}")
    text = (f"Its requests run on pools {'; '.join(parts)}." if parts else
            "No pool is open to it within its jurisdictions: its requests are refused.")
    if r.closed:
        text += f" Pools dedicated to other tenants, never used for it: {_names(p.name for p in r.closed)}."
    text += f" No capacity is reserved otherwise; whether the hosts run other workloads is {NOT_RECORDED}."
    return _answer(Question.ACCELERATORS, text, facts)


def _jurisdiction_warnings(d: Deployment, t: TenantSection, r: Reach) -> list[str]:
    site, where = d.cfg.router.site, d.jurisdiction(d.cfg.router.site)
    out = []
    if site is None:
        out.append("the router's site is not declared (router.site): where prompts are tokenized and logs, jobs "
                   "and usage are stored is not recorded")
    elif t.jurisdictions and where not in t.jurisdictions:
        out.append(f"the router at {site} ({where}) is outside the tenant's jurisdictions "
                   f"({_names(t.jurisdictions)}): its prompts are tokenized and its logs and jobs stored there")
    if not r.decodes:
        out.append("no decode pool is open to it within its jurisdictions: its requests are refused")
    out.extend(f"site {s} declares no jurisdiction" for s, j in r.sites() if j == "unspecified")
    return out


def jurisdictions(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(3) Where prompts, KV and outputs are processed, and logs and jobs stored."""
    router, stores = _router(d), _stores(d.cfg)
    reached = sorted({j for _, j in r.sites()} | ({router["jurisdiction"]} if router["jurisdiction"] else set()))
    warnings = _jurisdiction_warnings(d, t, r)
    facts = {"allowed_jurisdictions": list(t.jurisdictions) or "any", "router": router,
             "processing_sites": [{"site": s, "jurisdiction": j, "roles": [p.role for p in r.pools if p.site == s]}
                                  for s, j in r.sites()],
             "kv_links": r.links, "stores": {k: {"path": v, "host": router["host"], "site": router["site"],
                                          "jurisdiction": router["jurisdiction"]} for k, v in stores.items()},
             "backups": _section(getattr(d.cfg, "backups", None)) or "none configured",
             "jurisdictions_reached": reached, "warnings": warnings}
    links = _names((_link_text(lk) for lk in r.links), "no link (its prompts are computed where they are decoded)")
    words = _STORE_WORDS | ({"audit_log": "the audit log (who, when, where, how much, and its prompt and output "
                                          "text: log_prompts)"} if t.log_prompts else {})
    files = _names(f"{words[k]} {v or 'not set'}" for k, v in stores.items())
    text = (f"Its prompts are tokenized, and its outputs returned, by the router on {_router_where(d)}; prompts and KV "
            f"are processed at {_names((f'{s} ({j})' for s, j in r.sites()), 'no site')}; KV crosses {links}. "
            f"The router's files, on its host: {files}. Backups: {_section_text(facts['backups'])}. "
            f"Jurisdictions reached: {_names(reached)}.")
    text += "".join(f" WARNING: {w}." for w in warnings)
    return _answer(Question.JURISDICTIONS, text, facts)


def retention(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(4) How long each kind of record is kept; where its prompts may be reused."""
    cfg = d.cfg
    usage_days = getattr(cfg.router, "usage_retention_days", None)
    facts = {"job_retention_days": t.job_retention_days, "audit_retention_days": t.audit_retention_days,
             "operator_audit_retention_days": cfg.router.operator_audit_retention_days,
             "retention_sweep_s": cfg.router.retention_sweep_s, "usage_retention_days": usage_days,
             "log_prompts": t.log_prompts, "prefix_cache_shared_with": sorted(t.share_prefix_cache_with),
             "kv_cache": {"held_in": "worker memory", "memory_gib": cfg.cache.memory_gib,
                          "num_blocks": cfg.cache.num_blocks, "prefix_caching": cfg.cache.enable_prefix_caching},
             "other_uses": NOT_RECORDED}
    text = (f"Its batch jobs (requests and results) are deleted {t.job_retention_days:g} days after they finish and "
            f"its audit records after {t.audit_retention_days:g} days (swept every {cfg.router.retention_sweep_s:g} s); "
            f"operators' records are kept {cfg.router.operator_audit_retention_days:g} days. Its audit records "
            f"{'carry' if t.log_prompts else 'never carry'} prompt and output text (log_prompts: "
            f"{str(t.log_prompts).lower()}). Usage records: "
            f"{'no retention configured' if usage_days is None else f'{usage_days:g} days'}. KV lives only in worker "
            f"memory ({cfg.cache.memory_gib:g} GiB per worker) until evicted; its cached prefixes are reused "
            + (f"for its own requests and those of {_names(sorted(t.share_prefix_cache_with))}"
               if t.share_prefix_cache_with else "only for its own requests")
            + f". Any other use of its data by the operator is {NOT_RECORDED}.")
    return _answer(Question.RETENTION, text, facts)


def _sign_in(cfg: ClusterConfig, t: TenantSection) -> dict:
    return {"token": t.token_sha256 is not None, "client_certificate": cfg.tls.enabled,
            "anonymous": t.name == ANONYMOUS and cfg.auth.allow_anonymous}


def _sign_in_text(methods: dict) -> str:
    words = {"token": "a bearer token (only its SHA-256 is configured)",
             "client_certificate": "a client certificate naming it from the cluster CA",
             "anonymous": "no credentials at all (anonymous access is allowed on loopback)"}
    return _names((words[k] for k, on in methods.items() if on), "nothing: it cannot sign in", last="or")


def access(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(5) Who can read its prompts, outputs, jobs and records."""
    cfg = d.cfg
    co_tenants = sorted({n for p in r.pools for n in d.users_of(p)} - {t.name})
    readable = [lk["link"] for lk in r.links if not lk["encrypted"]]
    nixl = [lk["link"] for lk in r.links if "nixl" in lk["transport"]]
    facts = {"tenant_signs_in_with": _sign_in(cfg, t), "operators": _operators(cfg),
             "operators_read_prompts_in_audit": t.log_prompts, "router_files": _stores(cfg),
             "tenants_on_the_same_workers": co_tenants, "prefix_cache_shared_with": sorted(t.share_prefix_cache_with),
             "links_readable_on_the_wire": readable, "nixl_links": nixl,
             "vendor_staff": NOT_RECORDED, "host_administrators": NOT_RECORDED}
    text = (f"Users: whoever presents {_sign_in_text(facts['tenant_signs_in_with'])} acts as this tenant and sees "
            f"only its own jobs and usage. Administrators: {_operators_text(cfg)} manage the pools and read the "
            f"audit log{', which carries its prompts and outputs' if t.log_prompts else ''}; whoever can read the "
            f"router host's files reads its jobs and records. Other tenants on the same workers: {_names(co_tenants)} "
            f"(prefix caches apart unless shared; shared with: {_names(sorted(t.share_prefix_cache_with))}).")
    if readable:
        text += f" Its KV is readable on the wire of {_names(readable)} (protection: integrity)."
    if nixl:
        text += f" Over {_names(nixl)} (NIXL), any authenticated decode worker can read the senders' whole KV memory."
    text += f" Vendor staff and host administrators: {NOT_RECORDED}."
    return _answer(Question.ACCESS, text, facts)


def _policy(d: Deployment, t: TenantSection) -> dict:
    return {"jurisdictions": list(t.jurisdictions) or "any", "priority": str(t.priority), "weight": t.weight,
            "requests_per_minute": t.requests_per_minute, "tokens_per_minute": t.tokens_per_minute,
            "max_concurrent": t.max_concurrent, "max_context": t.max_context,
            "dedicated_pools": [p.name for p in d.pools if t.name in p.dedicated_to]}


def identity(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(6) Identity, transport security and the tenant's own policy."""
    cfg, tls = d.cfg, d.cfg.tls
    federated = _section(getattr(cfg.auth, "federated", None))
    policy = _policy(d, t)
    facts = {"sign_in": _sign_in(cfg, t), "federated_identity": federated or "not configured",
             "tls": {"enabled": tls.enabled, "ca": tls.ca, "mutual_tls_internal": tls.enabled,
                     "revoked_serials": len(tls.revoked_serials), "cert_days": tls.cert_days},
             "listeners": _router(d), "kv_links": [{k: lk[k] for k in ("link", "protection", "encrypted")}
                                                   for lk in r.links],
             "private_network_paths": NOT_RECORDED, "policy": policy}
    tls_text = (f"TLS is on for every listener, mutual TLS on the internal one and between workers, with "
                f"certificates from {'the CA ' + tls.ca if tls.ca else 'a CA the launcher made for this run'} "
                f"({len(tls.revoked_serials)} revoked serials)" if tls.enabled else
                "TLS is off (plaintext, allowed on loopback addresses only)")
    quotas = [f"{k.replace('_', ' ')} {policy[k]}" for k in ("requests_per_minute", "tokens_per_minute",
                                                             "max_concurrent", "max_context") if policy[k]]
    links = _names((_link_text(lk) for lk in r.links), "none")
    text = (f"It signs in with {_sign_in_text(facts['sign_in'])}; federated or institutional identity: "
            f"{_section_text(facts['federated_identity'])}. {tls_text}. KV links: {links}. Whether the links "
            f"are private network paths is {NOT_RECORDED}. Its policy: jurisdictions {_names(t.jurisdictions, 'any')}, "
            f"priority {t.priority} (weight {t.weight:g}), quotas {_names(quotas)}, dedicated pools "
            f"{_names(policy['dedicated_pools'])}.")
    return _answer(Question.IDENTITY, text, facts)


def responsibility(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(7) Who can act on monitoring, incidents, upgrades and capacity, and what kvrelay watches itself."""
    cfg, rs = d.cfg, d.cfg.router
    telemetry = _section(getattr(cfg, "telemetry", None))
    facts = {"operators": _operators(cfg), "telemetry": telemetry or "none configured",
             "health_checks": {"heartbeat_interval_s": rs.heartbeat_interval_s, "worker_timeout_s": rs.worker_timeout_s,
                               "link_probe_timeout_s": rs.link_probe_timeout_s},
             "operator_actions_logged_to": rs.audit_log,
             "capacity": [{k: p.facts()[k] for k in ("pool", "desired", "min_replicas", "max_replicas")}
                          for p in r.pools],
             "slo": {"ttft_s": rs.slo_ttft_s, "tpot_s": rs.slo_tpot_s}, "runtime_version": d.state.version,
             "incident_response": NOT_RECORDED, "upgrades": NOT_RECORDED}
    sizes = _names(f"{c['pool']} {c['desired']} (max {c['max_replicas']})" for c in facts["capacity"])
    text = (f"Operators ({_names(facts['operators']['tokens'])}) scale, drain and plan the pools; their actions go "
            f"to the audit log ({rs.audit_log or 'not set'}). Telemetry (traces, metrics): "
            f"{_section_text(facts['telemetry'])}; the "
            f"router marks a worker unhealthy after {rs.worker_timeout_s:g} s without a heartbeat and a link down when "
            f"a probe takes over {rs.link_probe_timeout_s:g} s. Capacity: {sizes}, sized against a time to first token "
            f"of {rs.slo_ttft_s:g} s and {rs.slo_tpot_s:g} s per output token (kvrelay plan). Runtime: kvrelay "
            f"{d.state.version}. Who answers incidents and schedules upgrades is {NOT_RECORDED}.")
    return _answer(Question.RESPONSIBILITY, text, facts)


def portability(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(8) How its jobs, records, the config and the model leave the deployment."""
    cfg, stores = d.cfg, _stores(d.cfg)
    path = d.state.model_path or cfg.model.path
    exports = [
        {"data": "batch jobs and results", "command": "kvrelay job results <job-id>", "store": stores["jobs_db"],
         "format": "JSON lines"},
        {"data": "audit records", "command": "kvrelay audit query --json", "store": stores["audit_log"],
         "format": "JSON lines, hash-chained"},
        {"data": "usage", "command": "kvrelay usage --json", "store": stores["usage_db"], "format": "JSON"},
        {"data": "configuration", "command": None, "store": None, "format": "YAML (the cluster config file)"},
        {"data": "model", "command": None, "store": path or "the embedded default (kvrelay model prepare)",
         "format": "Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json"}]
    apis = ["kvrelay.v1 gRPC"] + (["OpenAI-compatible HTTP"] if cfg.router.http_port is not None else [])
    facts = {"exports": exports, "apis": apis}
    commands = _names(f"{e['data']} with `{e['command']}`" for e in exports if e["command"])
    text = (f"Yes: {commands}; the "
            f"configuration is a YAML file and the model a checkpoint in open formats ({exports[-1]['format']}, "
            f"at {exports[-1]['store']}). Clients use {_names(apis)} APIs, which other services also offer.")
    return _answer(Question.PORTABILITY, text, facts)


ANSWERS = (operators, accelerators, jurisdictions, retention, access, identity, responsibility, portability)
"""One function per question, in order: (deployment, tenant, its reach) -> answer."""


# ------------------------------------------------------------------ the statement
def deployment_facts(d: Deployment) -> dict:
    """What the statement says of the whole deployment (every tenant's answers draw on it)."""
    return {"kvrelay_version": d.state.version, "router": _router(d), "stores": _stores(d.cfg),
            "sites": [{"site": s.name, "jurisdiction": s.jurisdiction,
                       "pools": [p.facts() for p in d.pools if p.site == s.name]} for s in d.cfg.sites],
            "operators": _operators(d.cfg), "telemetry": _section(getattr(d.cfg, "telemetry", None)),
            "workers": [dataclasses.asdict(w) for w in d.state.workers]}


def statement(cfg: ClusterConfig, state: DeploymentState, tenant: str | None = None) -> dict:
    """The data-handling statement (plain JSON data) for ``tenant``, or every
    tenant when None; UnknownTenant when the config has no such tenant."""
    d = Deployment.of(cfg, state)
    if tenant is not None and tenant not in d.reach:
        raise UnknownTenant(tenant, list(d.reach))
    out = []
    for t in d.tenants:
        if tenant is None or t.name == tenant:
            answers = [answer(d, t, d.reach[t.name]) for answer in ANSWERS]
            warnings = [w for a in answers for w in a["facts"].get("warnings", [])]
            out.append({"tenant": t.name, "warnings": warnings, "answers": answers})
    at = datetime.datetime.fromtimestamp(state.generated_at, datetime.UTC).isoformat(timespec="seconds")
    return {"generated_at": at.replace("+00:00", "Z"), "deployment": deployment_facts(d), "tenants": out}
