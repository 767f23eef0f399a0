"""Each link's rate and RTT as its transfers measure them (``router.placement.link_rates``).

A sender times every transfer on the wire: from its first byte written to the
receiver's acknowledgement, less the connection's least RTT (its TCP's
measurement), is the time its bytes took to cross. When the network set
the pace (its connections' TCP was held back by the network, not by the
prefill or the receiver's window, for nearly all of that time:
kvtransfer/channel.py), bytes over that time is the rate the transfer got
on the link; otherwise the link waited for someone else and the figure is
only a lower bound of its rate.

Transfers that cross a link between sites together share it: the router
counts those in flight on each (``LinkView.inflight``: placement prices a
new transfer at its share beside them), and each sample is divided by its
transfer's mean share of the link over its life (alone 1, beside one other
1/2), so the estimate is the link's rate, not one transfer's part of it
(exact when transfers share fairly and are on the wire while counted; one
still waiting for its prefill is counted too, which overstates the rate a
little). Within a site each site has its own local link: not counted.

Per link: a moving average of the link-bound samples (weight ``alpha``),
used once ``min_samples`` of them arrived; a lower bound above the estimate
raises it at once (the link is at least that fast); until measured, a lower
bound above the configured rate replaces it. A link with no transfer for
``max_age_s`` goes back to its configured figures, and its next samples
start afresh; having been measured before, one link-bound sample is then
enough. Meanwhile a link between sites gets its configured figure back for
one transfer at a time (a probe): while one crosses, placement keeps the
old measurement, so a link whose configured figure proved wrong does not
draw a burst of transfers before the probe lands. Pure: the caller passes the clock (the router and the
simulator share this code)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvrelay.router.placement.views import LinkView
from kvrelay.runtime.config import LinkRatesSection
from kvrelay.runtime.topology import LOCAL_LINK


@dataclass(frozen=True, slots=True)
class LinkSample:
    """One transfer across a link, as its sender timed it."""

    at: float
    """When it ended (the caller's clock, seconds)."""
    gbps: float
    """The link's rate as this transfer measured it: its bytes over its time on the wire, divided by its share
    of the link (Gbit/s on the wire; 0: not timed)."""
    bound: bool
    """The link set the pace: ``gbps`` is the link's rate, not a lower bound of it."""
    rtt_ms: float = 0.0
    """The connection's least RTT (0: unknown)."""
    share: float = 1.0
    """The transfer's mean share of the link over its life (1: alone on it); ``gbps`` counts the link's
    whole rate, ``gbps * share`` is what this transfer got."""

    @classmethod
    def of(cls, at: float, nbytes: int, wire_ms: float, rtt_ms: float, bound: bool, share: float = 1.0,
           busy_ms: float = 0.0) -> LinkSample:
        """From a sender's figures: ``nbytes`` on the wire for ``wire_ms`` (first byte to ack), the network
        carrying them for ``busy_ms`` of it (0: unknown, all of it less a round trip), with ``share`` of the
        link on average (LinkMeter.end)."""
        busy_ms = busy_ms or wire_ms - rtt_ms
        gbps = nbytes * 8 / (busy_ms * 1e6) / share if wire_ms > 0 and busy_ms > 0 and share > 0 else 0.0
        return cls(at, gbps, bound and gbps > 0, rtt_ms, share)


class RateSource(enum.StrEnum):
    """Where the rate placement uses for a link comes from."""

    CONFIGURED = "configured"
    MEASURED = "measured"
    """A moving average of link-bound transfers."""
    LOWER_BOUND = "lower bound"
    """Transfers faster than the configured rate, none link-bound yet."""


@dataclass(slots=True)
class LinkEstimate:
    """One link's measured figures."""

    gbps: float = 0.0
    """Moving average of link-bound samples (0: none since the last reset)."""
    floor_gbps: float = 0.0
    """The highest rate any recent transfer reached (a lower bound of the link's)."""
    rtt_ms: float = 0.0
    """Least RTT its transfers' connections measured lately (0: none)."""
    samples: int = 0
    """Link-bound samples in ``gbps``."""
    measured_before: bool = False
    """An earlier run of samples, since aged out, had reached ``min_samples``."""
    last_at: float = float("-inf")
    """When its last sample arrived."""

    def add(self, s: LinkSample, cfg: LinkRatesSection) -> None:
        if s.at - self.last_at > cfg.max_age_s:
            self.measured_before |= self.samples >= cfg.min_samples
            self.gbps, self.floor_gbps, self.rtt_ms, self.samples = 0.0, 0.0, 0.0, 0
        self.last_at = s.at
        if s.rtt_ms > 0:
            self.rtt_ms = s.rtt_ms if self.rtt_ms == 0 else min(s.rtt_ms, (self.rtt_ms + s.rtt_ms) / 2)
        if s.gbps <= 0:
            return
        if s.bound:
            self.gbps = s.gbps if self.samples == 0 else cfg.alpha * s.gbps + (1 - cfg.alpha) * self.gbps
            self.samples += 1
            self.floor_gbps = s.gbps  # the link's rate now: older lower bounds no longer hold
        else:
            self.floor_gbps = max(self.floor_gbps, s.gbps)
            if self.samples and s.gbps > self.gbps:
                self.gbps = s.gbps

    def measured(self, cfg: LinkRatesSection) -> bool:
        """Enough link-bound samples to use: ``min_samples``, or one when the link was measured before."""
        return self.samples >= (1 if self.measured_before else cfg.min_samples)

    def figures(self, now: float, gbps: float, rtt_ms: float, cfg: LinkRatesSection, probing: bool = False
                ) -> tuple[float, float, RateSource]:
        """(Gbit/s, RTT ms, where the rate comes from) for placement: measured where known and
        fresh, else the configured ``gbps`` and ``rtt_ms``; ``probing``: a transfer crosses the link now,
        so an aged-out measurement stays in use until it lands."""
        if not cfg.measure:
            return gbps, rtt_ms, RateSource.CONFIGURED
        if now - self.last_at > cfg.max_age_s:
            if probing and self.measured(cfg):
                return self.gbps, self.rtt_ms or rtt_ms, RateSource.MEASURED
            return gbps, rtt_ms, RateSource.CONFIGURED
        rtt = self.rtt_ms or rtt_ms
        if self.measured(cfg):
            return self.gbps, rtt, RateSource.MEASURED
        if self.floor_gbps > gbps:
            return self.floor_gbps, rtt, RateSource.LOWER_BOUND
        return gbps, rtt, RateSource.CONFIGURED


@dataclass(slots=True)
class _Sharing:
    """The transfers in flight on one link, and the integral over time of each one's share (1/n)."""

    n: int = 0
    shares: float = 0.0
    at: float = 0.0

    def advance(self, now: float) -> None:
        if self.n:
            self.shares += (now - self.at) / self.n
        self.at = max(self.at, now)


@dataclass(slots=True)
class Crossing:
    """One transfer in flight on a link (LinkMeter.begin), until LinkMeter.end."""

    link: str
    start: float
    shares: float
    """Its link's share integral when it began."""
    ended: bool = False


@dataclass(slots=True)
class _Metered:
    view: LinkView
    gbps: float
    """Its configured figures."""
    rtt_ms: float
    estimate: LinkEstimate
    source: RateSource = RateSource.CONFIGURED
    sharing: _Sharing = field(default_factory=_Sharing)


class LinkMeter:
    """The links' estimates, written into the LinkViews placement reads (their ``gbps`` and ``rtt_ms``
    become the figures in use; the configured ones are kept here)."""

    def __init__(self, links: list[LinkView], cfg: LinkRatesSection) -> None:
        self.cfg = cfg
        self._links = {lv.name: _Metered(lv, lv.gbps, lv.rtt_ms, LinkEstimate()) for lv in links}

    def begin(self, link: str, now: float) -> Crossing | None:
        """A transfer starts across ``link`` between sites (None: within a site, where each site has a
        link of its own that one count would mix up, or no link: colocated "")."""
        m = self._links.get(link)
        if m is None or link == LOCAL_LINK:
            return None
        m.sharing.advance(now)
        m.sharing.n += 1
        m.view.inflight = m.sharing.n
        self._apply(m, now)  # a probe of an aged-out link: its old measurement back while it crosses
        return Crossing(link, now, m.sharing.shares)

    def end(self, c: Crossing | None, now: float) -> float:
        """The transfer ``c`` ended (idempotent): its mean share of its link over its life (1: alone)."""
        m = self._links.get(c.link) if c is not None else None
        if c is None or m is None or c.ended:
            return 1.0
        c.ended = True
        m.sharing.advance(now)
        m.sharing.n -= 1
        m.view.inflight = m.sharing.n
        self._apply(m, now)
        span = now - c.start
        return min(1.0, (m.sharing.shares - c.shares) / span) if span > 0 else 1.0

    def observe(self, link: str, sample: LinkSample) -> None:
        """A transfer across ``link`` (by name) ended; unknown names are ignored (colocated: "")."""
        m = self._links.get(link)
        if m is not None:
            m.estimate.add(sample, self.cfg)
            self._apply(m, sample.at)

    def refresh(self, now: float) -> None:
        """Links whose estimates aged out go back to their configured figures."""
        for m in self._links.values():
            if m.source is not RateSource.CONFIGURED:
                self._apply(m, now)

    def _apply(self, m: _Metered, now: float) -> None:
        gbps, rtt_ms, m.source = m.estimate.figures(now, m.gbps, m.rtt_ms, self.cfg, probing=m.sharing.n > 0)
        if (gbps, rtt_ms) != (m.view.gbps, m.view.rtt_ms):  # a LinkView write invalidates derived matrices
            m.view.gbps, m.view.rtt_ms = gbps, rtt_ms

    def source(self, link: str) -> RateSource:
        m = self._links.get(link)
        return RateSource.CONFIGURED if m is None else m.source

    def status(self, link: str) -> LinkFigures | None:
        """``link``'s figures, configured and in use (None: no such link)."""
        m = self._links.get(link)
        return None if m is None else LinkFigures(m.gbps, m.rtt_ms, m.view.gbps, m.view.rtt_ms, m.source, m.estimate)


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """One link's figures for ``kvrelay status``."""

    configured_gbps: float
    configured_rtt_ms: float
    gbps: float
    """What placement uses now ..."""
    rtt_ms: float
    source: RateSource
    """... and where its rate comes from."""
    estimate: LinkEstimate


@dataclass(frozen=True, slots=True)
class LinkState:
    """One link between sites as /metrics shows it (router/core/observe.py LinkCollector)."""

    name: str
    up: bool
    gbps: float
    """The rate placement uses for it ..."""
    source: str
    """... and where that comes from (a RateSource's value)."""
    probed: bool = True
    """Between sites, its health probed (``up`` says so); False: the local link, always up."""
