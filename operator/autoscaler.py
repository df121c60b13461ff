"""The built-in autoscaler of an ExpertPool (``spec.autoscaling.mode: builtin``), pure logic.

**tokenRate (the default).** The servers' mean routed (token, expert) entries per second is the
load itself: it falls as 1 / servers when one is added, whatever a batch's fixed costs, so the
pool the load needs is ``total / target`` servers and nothing compounds. The target is
``HEADROOM`` x what one server carries at the SLO (p99 time per output token <=
``sloTimePerOutputTokenMillis``), learned by :class:`Capacity` from the pool's own readings (the
servers' token rate against the attention clients' p99 time per output token), unless the spec
gives ``targetTokensPerSecond`` by hand. In replica space, with ``t`` the target and ``T`` the
pool's total rate: scale up to ``ceil(T / t)`` as soon as a server carries more than ``t``, down
to ``ceil(T / t)`` when the pool holds more servers than ``ceil(T / ((1 - DOWN_TOLERANCE) t))``,
else hold. So a settled server runs at most at ``HEADROOM`` of its capacity at the SLO (the rest
absorbs the load's growth while added servers start), a settled pool never holds more than
``ceil(T / ((1 - DOWN_TOLERANCE) HEADROOM capacity)) <= ceil(1.15 x demand)`` servers (demand in
capacities at the SLO; the scale-down window holds the highest demand of the window), and on a
flat load the answer is a fixed point: no oscillation (the band between scaling up and down is 3%
of the load wide, whatever the pool's size). A rate that depends on the pool's size (a closed-loop
load on hardware that slows as servers are added) breaks that fixed point, so no scale-down is
taken while the clients' p99 time per output token is over the SLO (unless what was learned says
it is not the expert servers' load): a smaller pool cannot shorten it.

**busy and expertWait** follow the HorizontalPodAutoscaler's algorithm on their metric (the
servers' mean busy fraction; the attention clients' mean expert time per decoder step):
``desired = ceil(current * value / target)``, nothing within a 10% tolerance.

Every metric: clamped to [min, max]; scale up to the lowest and down to the highest
recommendation of the respective stabilisation window. Servers still starting (``ready <
current``) report no load yet: as the HPA does with unready pods, they count as idle when
deciding a scale-up (so a scale-up in progress is not compounded while its servers load their
experts) and no scale-down is made until they are ready. The operator writes the result through
the ExpertPool's ``/scale`` subresource, exactly like an HPA would (and never while an HPA owns
it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from eaas.operator.api.moeservice import AutoscalingSpec, LearnedCapacity
from eaas.runtime.contract import TPOT_WINDOW_S

TOLERANCE = 0.1  # busy and expertWait: the HPA's
HEADROOM = 0.9  # tokenRate learned: the target is this fraction of the capacity at the SLO
DOWN_TOLERANCE = 0.03  # tokenRate: scale down once the pool is sized below (1 - this) x the target
FRONTIER = 0.85  # below the SLO, the line is fitted to the bands at >= this x the highest rate seen
EXPLORE = 1.25  # the learned capacity is at most this x the highest rate seen meeting the SLO
SETTLE_S = TPOT_WINDOW_S  # readings count once the pool's size held as long as the p99's window ...
# ... and its token rate had no trend over that window: the mean of the window's second half
# within this of its first half's. Not the extremes: each reading is a 10 s average of a noisy rate
# (on two cores the servers' rate under a flat load swings +-8% from one second to the next), and
# extremes within 10% of each other may never come while the load itself is flat.
STEADY_BAND = 0.05
BUCKET_RATIO = 1.05  # readings are kept per 5%-wide band of the token rate
READINGS_PER_BUCKET = 15  # the newest, per band; a band reads as their median
NOT_THE_SERVERS = "not the expert servers' load"  # in the reason when the time per token is not theirs


def target(spec: AutoscalingSpec) -> int:
    """The metric's hand-set target in the units it is read in: busy thousandths, expert wait in
    us, or routed tokens per second per server (0 for tokenRate when the target is learned)."""
    if spec.metric == "expertWait":
        assert spec.target_expert_wait_millis is not None  # the CRD's rule
        return spec.target_expert_wait_millis * 1000
    if spec.metric == "tokenRate":
        return spec.target_tokens_per_second or 0
    return spec.target_utilization_milli


def raw_recommendation(current: int, value: int, spec: AutoscalingSpec) -> int:
    """busy and expertWait: replicas that would bring the metric to its target, clamped to [min, max]."""
    ratio = value / target(spec)
    desired = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(current * ratio)
    return clamp(desired, spec)


def clamp(replicas: int, spec: AutoscalingSpec) -> int:
    return min(max(replicas, spec.min_replicas), spec.max_replicas)


def token_rate_recommendation(current: int, total: float, per_server: float, spec: AutoscalingSpec) -> int:
    """tokenRate: the servers the pool's `total` routed tokens/s needs at `per_server` each (the
    target), with the band of the module docstring, clamped to [min, max]."""
    sized = math.ceil(total / per_server - 1e-9)
    if current < sized:  # a server carries more than the target
        return clamp(sized, spec)
    if current > math.ceil(total / ((1 - DOWN_TOLERANCE) * per_server) - 1e-9):
        return clamp(sized, spec)
    return clamp(current, spec)


@dataclass
class Capacity:
    """What one expert server of a pool carries at the SLO, learned from the pool's own readings:
    (routed tokens/s per server, the attention clients' p99 time per output token) once the pool's
    size has settled. Readings are kept per 5% band of the rate (the newest ``READINGS_PER_BUCKET``,
    read as their median) and fitted with a non-decreasing curve (pool-adjacent violators): a
    server does not get faster with more load, so a dip is noise.

    The estimate (:meth:`estimate`): where the fitted curve crosses the SLO, interpolated; with no
    band above the SLO, a line through the fitted curve's top (the bands at >= ``FRONTIER`` x the
    highest rate seen: a time per token that turns steeply up near saturation, as measured CPU
    servers' does within a few percent of the SLO, is not extrapolated from its flat part, which
    a pool running at its target mostly reads) extrapolated to the SLO, but never more than
    ``EXPLORE`` x the highest rate seen meeting it (the pool learns upwards by running there); with
    every band above the SLO, a line through the fitted curve extrapolated down to the SLO (one
    band: its rate scaled by SLO / its time; the next readings correct it), unless fewer tokens per
    server did not shorten the time per token (the curve falls by less than 10% over a 1.5x span of
    rates, or the line never reaches the SLO): then the time per token is not the expert servers'
    to fix (the attention pool, the network), and the estimate is the busiest rate seen, so the
    pool neither grows past what carried that load nor stays large once the load falls (the reason
    says so)."""

    slo_micros: int
    readings: dict[int, deque[tuple[float, int]]] = field(default_factory=dict)  # band: (rate, us)
    _medians: dict[int, tuple[float, float]] = field(default_factory=dict)  # band: (rate, us), kept current

    def observe(self, tokens_per_second: float, tpot_micros: int) -> None:
        if tokens_per_second <= 0 or tpot_micros <= 0:
            return  # an idle pool tells nothing about its capacity
        band = math.floor(math.log(tokens_per_second) / math.log(BUCKET_RATIO))
        readings = self.readings.setdefault(band, deque(maxlen=READINGS_PER_BUCKET))
        readings.append((tokens_per_second, tpot_micros))
        self._medians[band] = (median([r for r, _ in readings]), median([us for _, us in readings]))

    def bands(self) -> list[tuple[float, float, int]]:
        """(median rate, median time per token in us, readings) per band, lowest first: what
        :meth:`restore` takes back (the estimate depends on nothing else)."""
        return [(*self._medians[b], len(self.readings[b])) for b in sorted(self.readings)]

    def restore(self, bands: list[tuple[float, float, int]]) -> None:
        """Readings as :meth:`bands` gave them (each band's median, as many times as it had
        readings): the same curve, and the same estimate."""
        for rate, micros, count in bands:
            for _ in range(min(count, READINGS_PER_BUCKET)):
                self.observe(rate, round(micros))

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(rates [B] increasing, fitted p99 time per output token [B] non-decreasing, us): per
        band the median rate and the median time."""
        bands = sorted(self.readings)
        rates = np.array([self._medians[b][0] for b in bands], dtype=float)  # [B]
        times = [self._medians[b][1] for b in bands]
        return rates, isotonic(times, [len(self.readings[b]) for b in bands])

    def estimate(self) -> tuple[float | None, str]:
        """(tokens/s one server carries at the SLO or None, how it was found)."""
        if not self.readings:
            return None, "no readings yet"
        rates, fitted = self.curve()
        slo = float(self.slo_micros)
        above = np.nonzero(fitted > slo)[0]
        if above.size == 0:
            top = float(rates[-1])
            crossing = frontier_crossing(rates, fitted, slo)
            if crossing <= EXPLORE * top:
                return max(crossing, top), "the fitted time per token extrapolated to the SLO"
            return EXPLORE * top, f"{EXPLORE:g} x the highest rate seen meeting the SLO"
        first = int(above[0])
        if first > 0:
            r0, r1, y0, y1 = rates[first - 1], rates[first], fitted[first - 1], fitted[first]
            between = float(r0 + (slo - y0) * (r1 - r0) / (y1 - y0))
            # Between two distant bands a curve that steepens is under the chord: the line through
            # the bands below the SLO says where it crosses better, within the bands around it.
            crossing = frontier_crossing(rates[:first], fitted[:first], slo)
            if math.isfinite(crossing):
                between = max(between, min(crossing, float(r1)))
            return between, "where the fitted time per token crosses the SLO"
        if rates.size == 1:
            return float(rates[0] * slo / fitted[0]), "the one rate seen, scaled to the SLO"
        slope, intercept = np.polyfit(rates, fitted, 1)
        flat = fitted[0] > 0.9 * fitted[-1] and rates[-1] >= 1.5 * rates[0]
        if flat or slope <= 0 or intercept >= slo:
            return float(rates[-1]), (
                f"the SLO is missed even at {rates[0]:.0f} tokens/s per server, and fewer tokens per "
                f"server did not shorten the time per token: {NOT_THE_SERVERS}, so the target holds at "
                "the busiest rate seen"
            )
        return float((slo - intercept) / slope), "the fitted time per token extrapolated down to the SLO"


def frontier_crossing(rates: np.ndarray, fitted: np.ndarray, slo: float) -> float:
    """Where a line through the fitted curve's top (its bands at >= ``FRONTIER`` x its highest
    rate, at least two) reaches `slo`; infinite when there are too few bands or it does not rise."""
    near = rates >= FRONTIER * rates[-1]
    if near.sum() < 2:
        return math.inf
    slope, intercept = np.polyfit(rates[near], fitted[near], 1)
    return float((slo - intercept) / slope) if slope > 0 else math.inf


def isotonic(values: list[float], weights: list[int]) -> np.ndarray:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool-adjacent
    violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight_, count = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight_
            last[0] = (last[0] * last[1] + mean * weight_) / total
            last[1], last[2] = total, last[2] + count
    return np.array([mean for mean, _, count in blocks for _ in range(int(count))], dtype=float)


def steady(rates: list[int]) -> bool:
    """Whether a window of token-rate readings (oldest first) shows one load: the mean of its
    second half within ``STEADY_BAND`` of its first half's (a single reading is steady)."""
    if not rates:
        return False
    half = len(rates) // 2
    if half == 0:
        return True
    first, second = sum(rates[:half]) / half, sum(rates[half:]) / (len(rates) - half)
    return abs(second - first) <= STEADY_BAND * max(first, second)


@dataclass
class Autoscaler:
    """Recommendation history of one ExpertPool, and with a learned tokenRate target its
    :class:`Capacity`. The history is in memory (a restarted operator starts cautious, because
    scaling down needs a full window of low recommendations); the capacity is kept in the
    MoEService's status (``learnedCapacity``, :meth:`learned`), from which a restarted operator
    takes it back (:meth:`restore`), so its target holds across the restart."""

    history: deque[tuple[float, int]] = field(default_factory=deque)
    started: float | None = None
    capacity: Capacity | None = None
    per_server: float | None = None  # the tokenRate target of the last call (learned or hand-set)
    reason: str = ""  # how the learned target was found, or why there is none
    persisted: float | None = None  # when the learned capacity was last written to the status
    _sized: tuple[int, float] | None = None  # (replicas, since when) of the pool as last seen
    _rates: deque[tuple[float, int]] = field(default_factory=deque)  # (when, per-server rate) in the window

    def recommend(
        self,
        now: float,
        current: int,
        value: int | None,
        spec: AutoscalingSpec,
        ready: int | None = None,
        tpot_micros: int | None = None,
    ) -> int:
        """The replicas to set now (`current` when nothing should change). `now` is in seconds;
        `value` is the metric (``target``'s units) with the `ready` servers serving (None: all
        `current` are); `tpot_micros` the attention clients' p99 time per output token (tokenRate
        with a learned target)."""
        if self.started is None:
            self.started = now
        if self._sized is None or self._sized[0] != current:
            self._sized = (current, now)
        serving = ready if ready is not None and 0 <= ready < current else current
        per_server: float | None = None
        if spec.metric == "tokenRate":
            per_server = self._token_target(now, current, serving, value, spec, tpot_micros)
            self.per_server = per_server
        if value is None or (spec.metric == "tokenRate" and per_server is None):
            return clamp(current, spec)  # nothing to go by: keep what we have, within bounds
        if per_server is not None:
            recommendation = token_rate_recommendation(current, value * serving, per_server, spec)
        elif serving < current:  # some still starting: they count as idle
            recommendation = raw_recommendation(current, value * serving // current, spec)
        else:
            recommendation = raw_recommendation(current, value, spec)
        if serving < current:  # no scale-down while servers start
            recommendation = max(recommendation, current)
        if recommendation < current and self._missing_slo(spec, tpot_micros):
            recommendation = max(recommendation, min(current, spec.max_replicas))  # maxReplicas still binds
        self.history.append((now, recommendation))
        horizon = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
        while self.history and self.history[0][0] < now - horizon:
            self.history.popleft()
        if recommendation > current:
            window = [r for t, r in self.history if t >= now - spec.scale_up_stabilization_seconds]
            return max(current, min(window))
        if recommendation < current:
            if now - self.started < spec.scale_down_stabilization_seconds:
                return current  # not a full window observed yet
            window = [r for t, r in self.history if t >= now - spec.scale_down_stabilization_seconds]
            return min(current, max(window))
        return current

    def _missing_slo(self, spec: AutoscalingSpec, tpot_micros: int | None) -> bool:
        """tokenRate with a learned target: the attention clients' p99 time per output token is
        over the SLO and, as far as the readings tell, the expert servers' load is what sets it.
        A smaller pool cannot shorten the time per token, so no scale-down is taken then, whatever
        the rate says: where the pool's token rate falls as servers are added (a closed-loop load
        on a machine whose total throughput drops with more server processes), the rate alone
        would take the pool back down on a flat load and up again, for ever."""
        if spec.metric != "tokenRate" or spec.target_tokens_per_second is not None or tpot_micros is None:
            return False
        if tpot_micros <= spec.slo_time_per_output_token_millis * 1000:
            return False
        return self.capacity is None or NOT_THE_SERVERS not in self.reason

    def learned(self, slo_micros: int) -> dict[str, object] | None:
        """The learned capacity at the SLO, as ``status.learnedCapacity`` keeps it (None: nothing
        learned at this SLO)."""
        if self.capacity is None or self.capacity.slo_micros != slo_micros or not self.capacity.readings:
            return None
        estimate, _ = self.capacity.estimate()
        bands = [
            # 6 significant digits: a median rounded across a 5% band's edge would change bands
            {
                "tokensPerSecond": float(f"{rate:.6g}"),
                "timePerOutputTokenMicros": round(micros),
                "readings": count,
            }
            for rate, micros, count in self.capacity.bands()
        ]
        learned: dict[str, object] = {"sloTimePerOutputTokenMicros": slo_micros, "bands": bands}
        if estimate is not None:
            learned["tokensPerSecond"] = float(f"{estimate:.6g}")
        return learned

    def restore(self, learned: LearnedCapacity) -> None:
        """Takes back what :meth:`learned` kept (an operator that restarted)."""
        self.capacity = Capacity(learned.slo_time_per_output_token_micros)
        self.capacity.restore(
            [(b.tokens_per_second, b.time_per_output_token_micros, b.readings) for b in learned.bands]
        )

    def _token_target(
        self,
        now: float,
        current: int,
        serving: int,
        value: int | None,
        spec: AutoscalingSpec,
        tpot_micros: int | None,
    ) -> float | None:
        """tokenRate's per-server target: hand-set, or ``HEADROOM`` x the learned capacity, fed this
        reading when it describes one load: every server serving, the pool's size held for the p99's
        window (``SETTLE_S``), and the token rate without a trend over it (:func:`steady`). A p99
        over 30 s of a rising load reads the lower rates of the window's start: paired with the
        newest rate it says a server carries more than it does."""
        if spec.target_tokens_per_second is not None:
            return float(spec.target_tokens_per_second)
        slo = spec.slo_time_per_output_token_millis * 1000
        if self.capacity is None or self.capacity.slo_micros != slo:
            self.capacity = Capacity(slo)
        assert self._sized is not None
        if value is not None:
            self._rates.append((now, value))
        while self._rates and self._rates[0][0] < now - TPOT_WINDOW_S:
            self._rates.popleft()
        settled = serving == current and now - self._sized[1] >= SETTLE_S
        rates = [rate for _, rate in self._rates]
        if settled and steady(rates) and value is not None and tpot_micros is not None:
            self.capacity.observe(value, tpot_micros)
        capacity, self.reason = self.capacity.estimate()
        return HEADROOM * capacity if capacity is not None else None
