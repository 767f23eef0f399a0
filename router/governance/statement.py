"""The data-handling statement: the eight questions an institution asks of an
inference service, answered for each tenant from the live config and state,
never from text written in advance. Institutions file it with their records.

``statement(cfg, state, tenant)`` is a pure function (no I/O, no clock) over
the config and a :class:`DeploymentState` (router/governance/deployment.py; the Admin
API's ``Governance`` takes it from the registry, and the modes of the
router's files from the disk, in the router). Its JSON::

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
from pathlib import Path
from typing import Any

from kvrelay.router.core.auth import ANONYMOUS
from kvrelay.router.governance.deployment import (
    STORES,
    Deployment,
    DeploymentState,
    FileState,
    Pool,
    Reach,
    deployment_state,
)
from kvrelay.runtime.addresses import is_loopback
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.tenants import TenantSection
from kvrelay.runtime.topology import LOCAL_LINK

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
    if isinstance(value, type):
        raise TypeError(f"a config section is an instance, not the class {value.__name__}")
    return {k: str(v) if hasattr(v, "value") else v for k, v in dataclasses.asdict(value).items()}


def telemetry_facts(cfg: ClusterConfig) -> dict:
    """Where traces and metrics go and what they hold (``telemetry``)."""
    t = cfg.telemetry
    dest = {"none": None, "otlp": t.endpoint, "file": t.file}[t.traces.value]
    return {"traces": t.traces.value, "trace_destination": dest, "sample_ratio": t.sample_ratio,
            "span_content": "tenant, request id, sites, workers, link, transport, token counts and timings; "
                            "never prompt or output text",
            "metrics": "off" if t.router_metrics_port is None and t.worker_metrics_port is None else
                       f"/metrics on {t.metrics_host}" + (" (exposed beyond loopback)" if t.metrics_exposed else ""),
            "metrics_content": "per tenant request counts, token counts and latency histograms; per link KV "
                               "bytes and failures; per worker engine state; no request ids"}


def _telemetry_text(f: dict) -> str:
    traces = ("not traced" if f["traces"] == "none" else
              f"traced ({f['traces']} to {f['trace_destination']}, sample ratio {f['sample_ratio']:g}; spans hold "
              f"{f['span_content']})")
    return f"requests are {traces}; metrics: {f['metrics']} ({f['metrics_content']})"


def _section_text(value) -> str:
    """A section from :func:`_section` in a sentence."""
    if isinstance(value, dict):
        return "; ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def _router(d: Deployment) -> dict:
    r = d.cfg.router
    return {"site": r.site, "jurisdiction": d.jurisdiction(r.site), "host": r.host,
            "loopback_only": is_loopback(r.host), "port": r.port, "internal_port": r.internal_port,
            "http_port": r.http_port}


def _router_where(d: Deployment) -> str:
    r = d.cfg.router
    if r.site is None:
        return f"host {r.host}, at a site the config does not declare (router.site)"
    return f"host {r.host} at {r.site} ({d.jurisdiction(r.site)})"


def _stores(cfg: ClusterConfig) -> dict:
    """The router's files (on its host), None where the config names none."""
    return {name: getattr(cfg.router.records, name) for name in STORES}


_STORE_WORDS = {"audit_log": "the audit log (who, when, where, how much)",
                "jobs_db": "the jobs database (job requests and results)",
                "usage_db": "the usage records (request, token and KV-byte counts)"}
_STORE_NAMES = {"audit_log": "the audit log", "jobs_db": "the jobs database", "usage_db": "the usage database"}
AUDITED_ACTIONS = ("scale", "drain", "plan apply", "usage", "governance")
"""The Admin calls router/frontends/admin.py writes to the audit log with the operator
who made them (every call refused for its credentials too, as a ``refusal``)."""

_UNSET = {"audit_log": "nothing is audited", "jobs_db": "batch jobs are kept in the router's memory only",
          "usage_db": "usage is kept in the router's memory only"}
"""What the router does when ``router.<name>`` names no file (router/main.py, router/cluster/usage.py)."""


def _mode(mode: int | None) -> str | None:
    return None if mode is None else f"{mode:04o}"


def _readers(mode: int) -> str:
    """Who the permission bits let read a file."""
    return "any user" if mode & 0o004 else "its owner and group" if mode & 0o040 else "its owner only"


def _file(d: Deployment, name: str) -> dict:
    """``router.records.<name>`` as the router read it on disk (the snapshot's :class:`FileState`):
    state "read", "missing", why it could not be read, "not read" (no stat in the snapshot) or "not set"."""
    path = getattr(d.cfg.router.records, name)
    if path is None:
        return {"path": None, "state": "not set", "consequence": _UNSET[name]}
    fs: FileState | None = (d.state.files or {}).get(name)
    if fs is None:
        return {"path": path, "state": "not read"}
    out = {"path": path, "state": "read" if fs.mode is not None else fs.error}
    if fs.mode is not None:
        out |= {"mode": _mode(fs.mode), "readable_by": _readers(fs.mode), "owner_uid": fs.owner_uid}
    return out | {"folder": fs.folder, "folder_mode": _mode(fs.folder_mode),
                  "folder_state": "read" if fs.folder_mode is not None else fs.folder_error}


def _file_text(name: str, f: dict) -> str:
    """One file's facts from :func:`_file` in words."""
    words = _STORE_NAMES[name]
    if f["state"] == "not set":
        return f"{words}: not set (router.records.{name}; {f['consequence']})"
    if f["state"] == "not read":
        return f"{words} {f['path']} (its mode was not read)"
    folder = (f"in {f['folder']}, mode {f['folder_mode']}" if f["folder_mode"] is not None
              else f"in {f['folder']} ({f['folder_state']})")
    if f["state"] == "read":
        return f"{words} {f['path']}, mode {f['mode']} (readable by {f['readable_by']}), {folder}"
    if f["state"] == "missing":
        return f"{words} {f['path']}: missing on disk ({folder})"
    return f"{words} {f['path']}: its mode could not be read ({f['state']}; {folder})"


def _files(d: Deployment) -> dict:
    return {name: _file(d, name) for name in STORES}


def _link_text(lk: dict) -> str:
    where = "the network within each site" if lk["link"] == LOCAL_LINK else lk["link"]
    codec = lk.get("kv_codec", "none")
    chosen = f"per request among {'/'.join(lk.get('auto_codecs', []))}" if codec == "auto" else codec
    lossy = (f", KV coded {chosen}: fewer bytes, answers may differ (kv_lossy: false forbids it)"
             if codec != "none" else "")
    return f"{where} ({'/'.join(lk['transport'])}, {lk['protection']}{lossy})"


def _operators(cfg: ClusterConfig) -> dict:
    """Who holds operator credentials: token names, and whether the CA's operator certificates count."""
    return {"tokens": [c.name for c in cfg.auth.operators], "certificates_accepted": cfg.tls.enabled,
            "ca": cfg.tls.ca, "openid": [f"{r.operator} ({p.name}: {r.claim}={r.value})" for p in cfg.identity.oidc
                                         for r in p.rules if r.operator]}


def _operators_text(cfg: ClusterConfig) -> str:
    ops = _operators(cfg)
    certs = " and of any operator certificate from the cluster CA" if ops["certificates_accepted"] else ""
    openid = f", and OpenID operators {_names(ops['openid'])}" if ops["openid"] else ""
    return f"the holders of operator tokens ({_names(ops['tokens'])}){certs}{openid}"


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
    rs = d.cfg.router.admission
    reserved = {"interactive_reserve": rs.interactive_reserve, "max_inflight_per_worker": rs.max_inflight_per_worker,
                "applies_to": "every worker: batch (job) requests leave interactive_reserve of its "
                              "max_inflight_per_worker slots free for interactive requests",
                "job_concurrency": rs.job_concurrency,
                "jobs_start_only_while_no_interactive_request_waits": True,
                "engines_admit_waiting_interactive_prompts_first": True,
                "for_tenants": "none beyond dedicated pools"}
    facts = {"pools": pools, "closed_to_it": [p.facts() for p in r.closed],
             "reservations": reserved, "other_workloads_on_the_hosts": NOT_RECORDED}
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
    if rs.interactive_reserve:
        text += (f" Reserved for interactive requests: on every worker, batch (job) requests leave "
                 f"{rs.interactive_reserve} of its {rs.max_inflight_per_worker} slots free "
                 f"(router.admission.interactive_reserve of router.admission.max_inflight_per_worker)")
    else:
        text += (f" Reserved for interactive requests: no slot (router.admission.interactive_reserve is 0): "
                 f"batch (job) requests may take all {rs.max_inflight_per_worker} slots of a worker")
    text += (f"; the router starts job requests only while no interactive request waits for room, at most "
             f"{rs.job_concurrency} at once (router.admission.job_concurrency), and engines admit waiting "
             f"interactive prompts before batch ones. Nothing is reserved for any tenant beyond dedicated pools; "
             f"whether the hosts run other workloads is {NOT_RECORDED}.")
    return _answer(Question.ACCELERATORS, text, facts)


def _entry_routers(d: Deployment, t: TenantSection) -> list[dict] | None:
    """With several routers (``routers:``), each and whether it reads the tenant's prompts (its site in
    the tenant's jurisdictions: the others refuse them unread, router/core/pipeline.py ``door``); None with one."""
    if not d.cfg.routers:
        return None
    return [{"name": r.name, "site": r.site, "jurisdiction": d.jurisdiction(r.site),
             "reads_its_prompts": not t.jurisdictions or d.jurisdiction(r.site) in t.jurisdictions}
            for r in d.cfg.routers]


def _entry_text(entry: list[dict]) -> str:
    inside = [f"{r['name']} at {r['site']} ({r['jurisdiction']})" for r in entry if r["reads_its_prompts"]]
    outside = [r["name"] for r in entry if not r["reads_its_prompts"]]
    text = f"Its prompts enter, are tokenized, and its outputs returned only at the routers in its jurisdictions " \
           f"(its batch jobs' requests too: only those take and run them): {_names(inside, 'none')}"
    if outside:
        text += (f"; the others ({_names(outside)}) refuse its requests and its jobs' before reading them "
                 f"(kvrelay routers)")
    return text + (". Each router keeps its own files (below) on its host at its site"
                   if inside else "")


def _jurisdiction_warnings(d: Deployment, t: TenantSection, r: Reach) -> list[str]:
    site, where = d.cfg.router.site, d.jurisdiction(d.cfg.router.site)
    out = []
    entry = _entry_routers(d, t)
    if entry is not None:
        if not any(e["reads_its_prompts"] for e in entry):
            out.append("no router is in its jurisdictions: every router refuses its requests")
    elif site is None:
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
    router, stores, entry = _router(d), _stores(d.cfg), _entry_routers(d, t)
    readers = ({e["jurisdiction"] for e in entry if e["reads_its_prompts"]} if entry is not None else
               {router["jurisdiction"]} if router["jurisdiction"] else set())
    reached = sorted({j for _, j in r.sites()} | readers)
    warnings = _jurisdiction_warnings(d, t, r)
    facts = {"allowed_jurisdictions": list(t.jurisdictions) or "any", "router": router,
             "processing_sites": [{"site": s, "jurisdiction": j, "roles": [p.role for p in r.pools if p.site == s]}
                                  for s, j in r.sites()],
             "kv_links": r.links, "stores": {k: {"path": v, "host": router["host"], "site": router["site"],
                                          "jurisdiction": router["jurisdiction"]} for k, v in stores.items()},
             "backups": _section(getattr(d.cfg, "backups", None)) or NOT_RECORDED,
             "jurisdictions_reached": reached, "warnings": warnings}
    links = _names((_link_text(lk) for lk in r.links), "no link (its prompts are computed where they are decoded)")
    words = _STORE_WORDS | ({"audit_log": "the audit log (who, when, where, how much, and its prompt and output "
                                          "text: log_prompts)"} if t.log_prompts else {})
    files = _names(f"{words[k]} {v}" if v else f"{words[k]}: not set ({_UNSET[k]})" for k, v in stores.items())
    backups = (_section_text(facts["backups"]) if facts["backups"] != NOT_RECORDED else
               f"host backups are outside kvrelay's configuration, so whether and where these files are backed "
               f"up is {NOT_RECORDED}")
    if entry is not None:
        facts["routers"] = entry
    where = (_entry_text(entry) if entry is not None else
             f"Its prompts are tokenized, and its outputs returned, by the router on {_router_where(d)}")
    sites = _names((f'{s} ({j})' for s, j in r.sites()), 'no site')
    text = (f"{where}; prompts and KV are processed at {sites}; KV crosses {links}. "
            f"The router's files, on its host: {files}. Backups: {backups}. "
            f"Jurisdictions reached: {_names(reached)}.")
    text += "".join(f" WARNING: {w}." for w in warnings)
    return _answer(Question.JURISDICTIONS, text, facts)


def _kv_memory(cfg: ClusterConfig) -> str:
    c = cfg.cache
    if c.num_blocks is not None:
        return f"{c.num_blocks} blocks of {c.block_size} tokens per worker, cache.num_blocks"
    return f"{c.memory_gib:g} GiB per worker, cache.memory_gib"


def _heads_text(rs) -> str:
    """The retention answer's sentence on the audit log's signed heads (router.records)."""
    if not rs.audit_signing_key:
        return ("The log's head is not signed (router.records.audit_signing_key is not set): whoever can "
                "write the file can rewrite its tail undetected, unless its head was noted elsewhere. ")
    where = rs.audit_heads or rs.audit_log + ".heads"
    beside = rs.audit_heads is None or Path(rs.audit_heads).parent == Path(rs.audit_log).parent
    return (f"The log's head is signed with a key kept apart from it, when the router opens and closes the "
            f"log and every {rs.audit_head_interval_s:g} s, into {where} (and the router's log), each head "
            f"numbered and signing the one before: against a copy of the heads kept where the log's writer "
            f"cannot write, a rewritten or cut tail is found. "
            + ("That heads file is beside the log: whoever can write both can cut its last heads with the log's "
               "tail unseen (heads removed from its start or middle are still found), so only a copy kept "
               "elsewhere (the router's log shipped off the host) proves the tail. " if beside else ""))


def retention(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(4) How long each kind of record is kept; where its prompts may be reused."""
    cfg, rs = d.cfg, d.cfg.router.records
    usage_days = getattr(rs, "usage_retention_days", None)
    sharing = sorted(t.share_prefix_cache_with)
    prefix = cfg.cache.enable_prefix_caching
    facts = {"job_retention_days": t.job_retention_days, "jobs_kept_in": rs.jobs_db or "router memory",
             "max_stored_jobs": t.max_stored_jobs, "max_stored_job_bytes": t.max_stored_job_bytes,
             "min_free_bytes_for_jobs": rs.min_free_bytes_for_jobs, "min_free_bytes": rs.min_free_bytes,
             "audit_retention_days": t.audit_retention_days, "audit_log": rs.audit_log,
             "audit_heads_signed": bool(rs.audit_log and rs.audit_signing_key),
             "audit_heads": (rs.audit_heads or f"{rs.audit_log}.heads") if rs.audit_signing_key else None,
             "expired_audit_records": "replaced by tombstones (seq, time, kind, tenant, hash of the removed line)",
             "operator_audit_retention_days": rs.operator_audit_retention_days,
             "retention_sweep_s": rs.retention_sweep_s, "usage_retention_days": usage_days,
             "usage_kept_in": rs.usage_db or "router memory",
             "log_prompts": t.log_prompts, "prefix_cache_shared_with": sharing if prefix else [],
             "kv_cache": {"held_in": "worker memory", "memory_gib": cfg.cache.memory_gib,
                          "num_blocks": cfg.cache.num_blocks, "block_size": cfg.cache.block_size,
                          "prefix_caching": prefix},
             "other_uses": NOT_RECORDED}
    where = "in the jobs database" if rs.jobs_db else "in the router's memory only (router.records.jobs_db is not set)"
    text = (f"Its batch jobs (requests and results: its prompts and outputs, whatever log_prompts says) are kept "
            f"{where} and deleted {t.job_retention_days:g} days after they finish (done or cancelled), or sooner "
            f"by the tenant itself (`kvrelay job delete`). It may store {t.max_stored_jobs} jobs of "
            f"{t.max_stored_job_bytes} bytes in all at once (max_stored_jobs, max_stored_job_bytes); the router "
            f"refuses new jobs while less than {rs.min_free_bytes_for_jobs} bytes are free where its records are, "
            f"and new requests under {rs.min_free_bytes} (router.records), so that no audit record is lost. ")
    if rs.audit_log:
        text += (f"Its audit records are replaced by tombstones (sequence number, time, kind, tenant and the hash "
                 f"of the removed line stay, so the chain still verifies) {t.audit_retention_days:g} days after "
                 f"their time; records of no tenant (operator actions, worker registrations, retention records) "
                 f"after {rs.operator_audit_retention_days:g} days. ")
        text += _heads_text(rs)
    else:
        text += "Nothing is audited (router.records.audit_log is not set). "
    text += (f"The router's retention sweep runs when it starts and every {rs.retention_sweep_s:g} s "
             f"(router.records.retention_sweep_s), so a record may outlive its period by up to that long. ")
    if rs.audit_log:
        text += (f"Its audit records {'carry' if t.log_prompts else 'never carry'} prompt and output text "
                 f"(log_prompts: {str(t.log_prompts).lower()}). ")
    if usage_days is not None:
        text += f"Usage records: {usage_days:g} days. "
    elif rs.usage_db:
        text += ("Usage records (counts per minute, tenant, site, link, role and worker; no text) are never "
                 "deleted by kvrelay. ")
    else:
        text += ("Usage records are kept in the router's memory only (router.records.usage_db is not set) "
                 "until it stops. ")
    text += f"KV is held in worker memory ({_kv_memory(cfg)}); "
    if prefix:
        text += ("its blocks stay cached after a request until evicted, and its cached prefixes are reused "
                 + (f"for its own requests and those of {_names(sharing)}" if sharing else "only for its own requests"))
    else:
        text += ("its blocks are freed when its request ends and never reused for another prompt "
                 "(cache.enable_prefix_caching is false)")
    text += f". Any other use of its data by the operator is {NOT_RECORDED}."
    return _answer(Question.RETENTION, text, facts)


def _sign_in(cfg: ClusterConfig, t: TenantSection) -> dict:
    return {"token": t.token_sha256 is not None, "client_certificate": cfg.tls.enabled,
            "openid_token": any(r.tenant == t.name for p in cfg.identity.oidc for r in p.rules),
            "anonymous": t.name == ANONYMOUS and cfg.auth.allow_anonymous}


def _federated(cfg: ClusterConfig, tenant: str) -> list[dict]:
    """Each OpenID provider: what it is, and which claims act as this tenant and as operators."""
    return [{"provider": p.name, "issuer": p.issuer, "audience": p.audience, "algorithms": list(p.algorithms),
             "as_this_tenant": [f"{r.claim}={r.value}" for r in p.rules if r.tenant == tenant],
             "as_other_tenants": sum(1 for r in p.rules if r.tenant not in (None, tenant)),
             "as_operators": [f"{r.claim}={r.value} (operator {r.operator})" for r in p.rules if r.operator]}
            for p in cfg.identity.oidc]


def _federated_text(providers: list[dict]) -> str:
    if not providers:
        return "not configured (tenants sign in with kvrelay's own tokens or cluster-CA certificates)"
    return "; ".join(
        f"OpenID Connect provider {p['provider']} (issuer {p['issuer']}, audience {p['audience']}, "
        f"{'/'.join(p['algorithms'])} signatures checked against its published keys): tokens whose "
        f"{_names(p['as_this_tenant'], 'no claim', last='or')} act as this tenant, "
        f"{_names(p['as_operators'], 'none', last='or')} as operators" for p in providers)


def _sign_in_text(methods: dict) -> str:
    words = {"token": "a bearer token (only its SHA-256 is configured)",
             "client_certificate": "a client certificate naming it from the cluster CA (gRPC on the internal "
                                   "port, and the HTTPS API)",
             "openid_token": "an access token of an OpenID provider whose claims map to it (identity.oidc)",
             "anonymous": "no credentials at all (anonymous access is allowed on loopback)"}
    return _names((words[k] for k, on in methods.items() if on), "nothing: it cannot sign in", last="or")


def access(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(5) Who can read its prompts, outputs, jobs and records."""
    cfg = d.cfg
    co_tenants = sorted({n for p in r.pools for n in d.users_of(p)} - {t.name})
    readable = [lk["link"] for lk in r.links if not lk["encrypted"]]
    nixl = [lk["link"] for lk in r.links if "nixl" in lk["transport"]]
    files = _files(d)
    sharing = sorted(t.share_prefix_cache_with) if cfg.cache.enable_prefix_caching else []
    facts: dict[str, Any]
    facts = {"tenant_signs_in_with": _sign_in(cfg, t),
             "tenant_sees": {"jobs": "its own only", "usage": "its own only (Admin.Usage, `kvrelay usage`)",
                             "statement": "its own only (Admin.Governance, `kvrelay governance`)",
                             "audit_records": "no: a file on the router's host"},
             "operators": _operators(cfg),
             "operators_see": ["usage of every tenant (Admin.Usage)", "this statement (Admin.Governance)",
                               "pools and workers"],
             "audit_log_carries_prompts": t.log_prompts, "router_files": files,
             "tenants_on_the_same_workers": co_tenants, "prefix_cache_shared_with": sharing,
             "links_readable_on_the_wire": readable, "nixl_links": nixl,
             "vendor_staff": NOT_RECORDED, "host_administrators": NOT_RECORDED}
    records = cfg.router.records
    held = (["the jobs database holds its batch jobs' prompts and outputs"] if records.jobs_db else []) + (
        ["the audit log holds its prompts and outputs (log_prompts)"] if t.log_prompts and records.audit_log else [])
    text = (f"Users: whoever presents {_sign_in_text(facts['tenant_signs_in_with'])} acts as this tenant: it sends "
            f"requests and sees its own batch jobs only (another tenant's job is as unknown as a missing one); "
            f"it reads its own usage and this statement, never another tenant's (Admin.Usage and Admin.Governance "
            f"with its own credentials). Administrators: "
            f"{_operators_text(cfg)} scale and drain the pools and read every tenant's usage and this statement "
            f"through the Admin API, which serves no prompt, output or audit record. The router's files are read "
            f"on its host by whoever its file permissions let (as read there: "
            f"{'; '.join(_file_text(k, f) for k, f in files.items())}){': ' + _names(held) if held else ''}. "
            f"Other tenants whose requests may run on the same workers: {_names(co_tenants)} ("
            + (f"prefix caches apart unless shared; shared with: {_names(sharing)})." if cfg.cache.enable_prefix_caching
               else "no prefix cache: cache.enable_prefix_caching is false)."))
    if readable:
        text += f" Its KV is readable on the wire of {_names(readable)} (protection: integrity)."
    if nixl:
        text += f" Over {_names(nixl)} (NIXL), any authenticated decode worker can read the senders' whole KV memory."
    shared = _shared_stores(cfg)
    if shared is not None:
        facts["shared_stores"], words = shared
        text += " " + words
    text += f" Vendor staff and host administrators: {NOT_RECORDED}."
    return _answer(Question.ACCESS, text, facts)


_YOUR_CRL = NOT_RECORDED + " (your server: kvrelay stores crl makes the revocation list to give it)"


def _shared_stores(cfg: ClusterConfig) -> tuple[dict, str] | None:
    """With several routers, what their etcd and PostgreSQL hold and whom they admit (None with one)."""
    if len(cfg.routers) < 2:
        return None
    ours_etcd, ours_pg = not cfg.etcd.endpoints, not cfg.postgres.endpoints
    started = "started by kvrelay serve at " + cfg.routers[0].site
    facts = {"etcd": {"holds": "membership, workers, pool sizes, drains, quota figures; no prompt",
                      "servers": started if ours_etcd else list(cfg.etcd.endpoints),
                      "admits": "the routers' certificates only (a user per router, a role on etcd.prefix)" if ours_etcd
                      else NOT_RECORDED + " (your etcd: kvrelay stores etcd-users prints the users and roles to make)",
                      "revoked_certificates": "refused (its revocation list, read at each handshake; open "
                                              "connections ended)" if ours_etcd else _YOUR_CRL},
             "postgres": {"holds": "every tenant's batch jobs: prompts and outputs",
                          "servers": started if ours_pg else list(cfg.postgres.endpoints),
                          "admits": "the routers' certificates, as one database role: any router may read every "
                                    "tenant's jobs there (each takes and serves only those of the tenants whose "
                                    "prompts may enter at its site)",
                          "revoked_certificates": "refused (its revocation list, reloaded; sessions of a serial newly "
                                                  "revoked ended)" if ours_pg else _YOUR_CRL}}
    e, pg = facts["etcd"], facts["postgres"]
    words = (f"The routers share state in etcd ({_servers_text(e['servers'])}: {e['holds']}), which admits "
             f"{e['admits']}; revoked certificates there: {e['revoked_certificates']}. Batch jobs are in PostgreSQL "
             f"({_servers_text(pg['servers'])}), which holds {pg['holds']} and admits {pg['admits']}; revoked "
             f"certificates there: {pg['revoked_certificates']}; its administrators: {NOT_RECORDED}.")
    return facts, words


def _servers_text(servers: str | list[str]) -> str:
    return servers if isinstance(servers, str) else "your servers at " + ", ".join(servers)


def _policy(d: Deployment, t: TenantSection) -> dict:
    return {"jurisdictions": list(t.jurisdictions) or "any", "priority": str(t.priority), "weight": t.weight,
            "requests_per_minute": t.requests_per_minute, "tokens_per_minute": t.tokens_per_minute,
            "max_concurrent": t.max_concurrent, "max_context": t.max_context,
            "dedicated_pools": [p.name for p in d.pools if t.name in p.dedicated_to]}


_QUOTA_WORDS = {"requests_per_minute": "{} requests per minute", "tokens_per_minute":
                "{} tokens per minute (prompt + max_tokens held at admission, the unused part returned)",
                "max_concurrent": "{} requests in progress at once", "max_context": "{} tokens of prompt + max_tokens "
                                                                                   "per request"}


def identity(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(6) Identity, transport security and the tenant's own policy."""
    cfg, tls = d.cfg, d.cfg.tls
    federated = _federated(cfg, t.name)
    policy = _policy(d, t)
    facts: dict[str, Any]
    facts = {"sign_in": _sign_in(cfg, t), "federated_identity": federated or "not configured",
             "tls": {"enabled": tls.enabled, "ca": tls.ca, "mutual_tls_internal": tls.enabled,
                     "revoked_serials": len(tls.revoked_serials), "cert_days": tls.cert_days},
             "listeners": _router(d), "kv_links": [{k: lk[k] for k in ("link", "protection", "encrypted", "kv_codec")}
                                                   for lk in r.links],
             "private_network_paths": NOT_RECORDED, "policy": policy}
    tls_text = (f"TLS is on for every listener, mutual TLS on the internal one and between workers, with "
                f"certificates from {'the CA ' + tls.ca if tls.ca else 'a CA the launcher made for this run'} "
                f"({len(tls.revoked_serials)} revoked serials) that the launcher issues for {tls.cert_days:g} days "
                "and renews after two thirds of that, each process taking its new one without a restart"
                if tls.enabled else "TLS is off (plaintext, allowed on loopback addresses only)")
    quotas = [_QUOTA_WORDS[k].format(policy[k]) for k in _QUOTA_WORDS if policy[k]]
    quota_text = (f"quotas {_names(quotas)} (over a rate or concurrency quota an interactive request is refused "
                  "with a time to retry; a batch one waits, its owner's jobs paused until then)"
                  if quotas else "no quotas")
    links = _names((_link_text(lk) for lk in r.links), "none")
    federated_text = _federated_text(federated)
    text = (f"It signs in with {_sign_in_text(facts['sign_in'])}; federated or institutional identity: "
            f"{federated_text}. {tls_text}. KV links: {links}. Whether the links are private network paths is "
            f"{NOT_RECORDED}. Its policy: jurisdictions {_names(t.jurisdictions, 'any')}"
            f"{' (a request asking for others is narrowed to these, never widened)' if t.jurisdictions else ''}; "
            f"{quota_text}; priority class {t.priority} and weight {t.weight:g}, "
            f"which order the requests waiting at the router for room (higher classes first, interactive before "
            f"batch, then by weight: weighted fair queueing); dedicated pools {_names(policy['dedicated_pools'])}.")
    return _answer(Question.IDENTITY, text, facts)


def responsibility(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(7) Who can act on monitoring, incidents, upgrades and capacity, and what kvrelay watches itself."""
    cfg, rs = d.cfg, d.cfg.router
    live = rs.liveness
    facts: dict[str, Any]
    facts = {"operators": _operators(cfg), "telemetry": telemetry_facts(cfg),
             "health_checks": {"heartbeat_interval_s": live.heartbeat_interval_s,
                               "worker_timeout_s": live.worker_timeout_s,
                               "link_probe_timeout_s": live.link_probe_timeout_s},
             "operator_actions_logged_to": rs.records.audit_log,
             "operator_actions_logged": [*AUDITED_ACTIONS, "refused credentials"],
             "capacity": [{k: p.facts()[k] for k in ("pool", "desired", "min_replicas", "max_replicas")}
                          for p in r.pools],
             "slo": {"ttft_s": rs.pools.slo_ttft_s, "tpot_s": rs.pools.slo_tpot_s}, "runtime_version": d.state.version,
             "incident_response": NOT_RECORDED, "upgrades": NOT_RECORDED}
    sizes = _names(f"{c['pool']} {c['desired']} (max {c['max_replicas']})" for c in facts["capacity"])
    logged = (f"are written to the audit log ({rs.records.audit_log})" if rs.records.audit_log else
              "are not audited (router.records.audit_log is not set)")
    text = (f"Operators ({_operators_text(cfg)}) scale, drain and plan the pools; their "
            f"{_names(AUDITED_ACTIONS)} calls, and calls refused for their credentials, {logged}. "
            f"Telemetry: {_telemetry_text(facts['telemetry'])}; the "
            f"router marks a worker unhealthy after {live.worker_timeout_s:g} s without a heartbeat and a link down "
            f"when a probe takes over {live.link_probe_timeout_s:g} s. Capacity: {sizes}; `kvrelay plan` recommends "
            f"sizes for a time to first token of {rs.pools.slo_ttft_s:g} s and {rs.pools.slo_tpot_s:g} s per output "
            f"token, applied only when an operator runs it with --apply. Runtime: kvrelay {d.state.version}. Who "
            f"answers incidents and schedules upgrades is {NOT_RECORDED}.")
    return _answer(Question.RESPONSIBILITY, text, facts)


def portability(d: Deployment, t: TenantSection, r: Reach) -> dict:
    """(8) How its jobs, records, the config and the model leave the deployment, and who can take them out."""
    cfg, stores = d.cfg, _stores(d.cfg)
    path = d.state.model_path or cfg.model.path
    ops = _operators_text(cfg)
    audit = stores["audit_log"]
    exports = [
        {"data": "batch jobs and results", "who": "the tenant itself (its own credential)",
         "command": "kvrelay job status; kvrelay job results <job-id>", "store": stores["jobs_db"],
         "format": "JSON lines"},
        {"data": "audit records",
         "who": (f"through the operators: whoever can read {audit} on the router's host" if audit else
                 "nobody: nothing is audited (router.records.audit_log is not set)"),
         "command": f"kvrelay audit query --file {audit} --tenant {t.name} --json" if audit else None,
         "store": audit, "format": "JSON lines, hash-chained"},
        {"data": "usage", "who": f"through the operators: {ops} (operator credentials)",
         "command": f"kvrelay usage --tenant {t.name} --json", "store": stores["usage_db"], "format": "JSON"},
        {"data": "configuration", "who": NOT_RECORDED, "command": None, "store": None,
         "format": "YAML (the cluster config file)"},
        {"data": "model", "who": NOT_RECORDED, "command": None,
         "store": path or "the embedded default (kvrelay model prepare)",
         "format": "Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json"}]
    apis = ["kvrelay.v1 gRPC"] + (["OpenAI-compatible HTTP"] if cfg.router.http_port is not None else [])
    facts = {"exports": exports, "apis": apis}
    text = ("It takes out its own batch jobs itself, with its own credential: `kvrelay job status` lists them and "
            "`kvrelay job results <job-id>` gives each one's results (JSON lines). Through the operators: ")
    text += (f"its audit records with `{exports[1]['command']}`, which reads the file on the router's host (whoever "
             f"can read it there); " if audit else "no audit records (router.records.audit_log is not set); ")
    text += (f"its usage with `{exports[2]['command']}`, which needs operator credentials ({ops}). The "
             f"configuration is a YAML file and the model a checkpoint in open formats ({exports[-1]['format']}, "
             f"at {exports[-1]['store']}). Clients use {_names(apis)} APIs, which other services also offer.")
    return _answer(Question.PORTABILITY, text, facts)


ANSWERS = (operators, accelerators, jurisdictions, retention, access, identity, responsibility, portability)
"""One function per question, in order: (deployment, tenant, its reach) -> answer."""


# ------------------------------------------------------------------ the statement
def deployment_facts(d: Deployment) -> dict:
    """What the statement says of the whole deployment (every tenant's answers draw on it)."""
    return {"kvrelay_version": d.state.version, "router": _router(d), "stores": _stores(d.cfg),
            "files": _files(d),
            "sites": [{"site": s.name, "jurisdiction": s.jurisdiction,
                       "pools": [p.facts() for p in d.pools if p.site == s.name]} for s in d.cfg.sites],
            "operators": _operators(d.cfg), "telemetry": telemetry_facts(d.cfg),
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
