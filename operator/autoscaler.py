"""The built-in autoscaler of an ExpertPool (``spec.autoscaling.mode: builtin``), pure logic.

It follows the HorizontalPodAutoscaler's algorithm on one metric (``spec.autoscaling.metric``):
the servers' mean busy fraction, the attention clients' mean expert time per decoder step, or
the servers' mean routed tokens per second:
``desired = ceil(current * value / target)``, nothing within a 10% tolerance,
clamped to [min, max]; scale up to the lowest and down to the highest recommendation of the
respective stabilisation window. Servers still starting (``ready < current``) report no load yet:
as the HPA does with unready pods, they count as idle when deciding a scale-up (so a scale-up
in progress is not compounded while its servers load their experts) and no scale-down is made
until they are ready. The operator writes the result through the ExpertPool's
``/scale`` subresource, exactly like an HPA would (and never while an HPA owns it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from eaas.operator.api.moeservice import AutoscalingSpec

TOLERANCE = 0.1


def target(spec: AutoscalingSpec) -> int:
    """The metric's target in the units it is read in: busy thousandths, expert wait in us, or
    routed tokens per second per server."""
    if spec.metric == "expertWait":
        assert spec.target_expert_wait_millis is not None  # the CRD's rule
        return spec.target_expert_wait_millis * 1000
    if spec.metric == "tokenRate":
        assert spec.target_tokens_per_second is not None  # the CRD's rule
        return spec.target_tokens_per_second
    return spec.target_utilization_milli


def raw_recommendation(current: int, value: int, spec: AutoscalingSpec) -> int:
    """Replicas that would bring the metric to its target, clamped to [min, max]."""
    ratio = value / target(spec)
    desired = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(current * ratio)
    return min(max(desired, spec.min_replicas), spec.max_replicas)


@dataclass
class Autoscaler:
    """Recommendation history of one ExpertPool (in memory: a restarted operator starts cautious,
    because scaling down needs a full window of low recommendations)."""

    history: deque[tuple[float, int]] = field(default_factory=deque)
    started: float | None = None

    def recommend(
        self,
        now: float,
        current: int,
        value: int | None,
        spec: AutoscalingSpec,
        ready: int | None = None,
    ) -> int:
        """The replicas to set now (`current` when nothing should change). `now` is in seconds;
        `value` is the metric (``target``'s units) with the `ready` servers serving (None: all
        `current` are)."""
        if self.started is None:
            self.started = now
        if value is None:  # nothing reports load: keep what we have, within bounds
            return min(max(current, spec.min_replicas), spec.max_replicas)
        if ready is not None and 0 <= ready < current:  # some still starting: they count as idle
            as_idle = value * ready // current  # their share of the load taken, once they serve
            recommendation = max(raw_recommendation(current, as_idle, spec), current)
        else:
            recommendation = raw_recommendation(current, value, spec)
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
