"""The retention sweeper: every ``router.records.retention_sweep_s`` it deletes what
the tenants' policy says is kept no longer.

- Batch jobs: a finished job (done or cancelled, no request still running)
  is deleted with its requests and results ``job_retention_days`` after it
  finished. Each deletion is written to the audit log first (a ``job``
  record ``{action: expired, job, tenant, requests_deleted}``), so none
  goes unrecorded.
- Audit records: a tenant's are tombstoned ``audit_retention_days`` after
  their ``time``; records of no tenant (operator actions, registrations,
  the retention records themselves) after
  ``router.records.operator_audit_retention_days``. The audit log appends a
  ``retention`` record listing them and the cutoff applied per tenant
  (router/governance/audit.py).

A job's owner that is no configured tenant ("" without authentication, a
tenant since removed) gets the defaults of ``TenantSection``. ``clock``
stands for "now" everywhere (tests move it ahead)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.router.core.jobs_store import JobStorage
from kvrelay.router.core.records import RecordKind
from kvrelay.router.governance.audit import OTHER_TENANTS, AuditLog, parse_time
from kvrelay.router.governance.audit_writer import AuditWriter
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.tenants import TenantSection

log = logging.getLogger(__name__)

DAY_S = 86_400.0
DEFAULT_POLICY = TenantSection(name="default")
"""The retention of an owner that is not a configured tenant."""


@dataclass(slots=True)
class RetentionReport:
    """What one sweep deleted, per tenant ("": records of no tenant, jobs without an owner)."""

    jobs_deleted: dict[str, int] = field(default_factory=dict)
    requests_deleted: dict[str, int] = field(default_factory=dict)
    """Requests (with their results) of the deleted jobs."""
    audit_records_deleted: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.jobs_deleted or self.audit_records_deleted)


class RetentionSweeper:
    """Deletes expired jobs and audit records, on demand (:meth:`sweep_once`) or periodically (:meth:`run`)."""

    def __init__(self, cfg: ClusterConfig, jobs_store: JobStorage | None, audit: AuditLog | AuditWriter | None,
                 clock: Callable[[], float] = time.time) -> None:
        """``jobs_store``: the router's job store (the Jobs service's: its
        calls are serialized, so this thread may share it); None: no jobs to
        sweep. ``audit``: the router's audit log (None: none to sweep, and
        deletions go unrecorded)."""
        self.cfg = cfg
        self.jobs = jobs_store
        self.audit = audit
        self.clock = clock

    def policy(self, tenant: str) -> TenantSection:
        """The retention policy of ``tenant`` (an unknown one: the defaults)."""
        return self.cfg.tenant(tenant) or DEFAULT_POLICY

    def sweep_once(self) -> RetentionReport:
        """One sweep, jobs then audit records. Blocking (disk): call it in a thread."""
        now = self.clock()
        report = RetentionReport()
        if self.jobs is not None:
            self._sweep_jobs(self.jobs, now, report)
        if self.audit is not None:
            result = self.audit.sweep(self._audit_expired(now), self._audit_cutoffs(now))
            report.audit_records_deleted = dict(result.counts)
        return report

    def _sweep_jobs(self, jobs: JobStorage, now: float, report: RetentionReport) -> None:
        shortest = min(t.job_retention_days for t in [*self.cfg.tenants, DEFAULT_POLICY])
        for row in jobs.finished_before(now - shortest * DAY_S):
            if row.finished >= now - self.policy(row.owner).job_retention_days * DAY_S:
                continue  # its owner keeps jobs longer
            if self.audit is not None:  # recorded before it is gone: no deletion goes unrecorded
                self.audit.append_durable(RecordKind.JOB, {"action": "expired", "job": row.id,
                                                           "tenant": row.owner, "requests_deleted": row.total})
            n = jobs.delete(row.id)
            if n is None:
                continue  # deleted meanwhile (by its owner)
            report.jobs_deleted[row.owner] = report.jobs_deleted.get(row.owner, 0) + 1
            report.requests_deleted[row.owner] = report.requests_deleted.get(row.owner, 0) + n
            log.info("job %s of %r expired: deleted with its %d requests", row.id, row.owner, n)

    def _audit_cutoffs(self, now: float) -> dict[str, float]:
        """The Unix time before which audit records expire at ``now``, per
        tenant ("": records of no tenant; OTHER_TENANTS: an unknown tenant's),
        as the audit log's retention record notes them."""
        cutoffs = {t.name: now - t.audit_retention_days * DAY_S for t in self.cfg.tenants}
        cutoffs[""] = now - self.cfg.router.records.operator_audit_retention_days * DAY_S
        cutoffs[OTHER_TENANTS] = now - DEFAULT_POLICY.audit_retention_days * DAY_S
        return cutoffs

    def _audit_expired(self, now: float) -> Callable[[dict], bool]:
        """Whether an audit record is past its retention at ``now``."""
        operator_days = self.cfg.router.records.operator_audit_retention_days

        def expired(record: dict) -> bool:
            days = (self.policy(str(record["tenant"])).audit_retention_days if "tenant" in record
                    else operator_days)
            try:
                when = parse_time(str(record["time"])).timestamp()
            except ValueError:
                return False  # a time that does not parse is kept (verify shows the record)
            return when < now - days * DAY_S
        return expired

    async def run(self, stop: asyncio.Event) -> None:
        """Sweeps now and then every ``router.records.retention_sweep_s`` until
        ``stop`` is set; a failed sweep is logged and the next one comes as usual."""
        interval = self.cfg.router.records.retention_sweep_s
        while not stop.is_set():
            try:
                report = await asyncio.to_thread(self.sweep_once)
            except Exception:  # the disk, a broken audit log: logged, and the sweeps go on
                log.exception("retention sweep failed; the next one in %.0f s", interval)
            else:
                if not report.empty:
                    log.info("retention: deleted jobs %s, audit records %s", report.jobs_deleted,
                             report.audit_records_deleted)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
