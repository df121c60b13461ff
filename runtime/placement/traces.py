"""Synthetic routing loads that age a placement: skewed, drifting, with domain switches.

Per layer, expert popularity is log-normal (per-rank loads of DeepSeek-V3 fit a log-normal best)
and built from three parts:

- a part shared by all workloads and a part specific to the current *phase* (``chat`` → ``code`` →
  ``math`` → ``chat`` ...; at a switch the popularity blends into the next phase's over
  ``switch_steps`` steps);
- a slow drift (a few random sinusoids per expert with periods around ``drift_steps``);
- per-step sampling noise (a Gaussian approximation of Poisson counts).

The default ``popularity_sigma`` is calibrated so that the DeepSeek-V3 shape (58 layers x 256
experts) on 64 servers without balancing (round-robin, 4 experts per server) has a per-server
max/mean of about 2.5 per step — the TensorRT-LLM DeepSeek-R1 wide-EP figure (average 2.56).

Shapes: T = steps, L = MoE layers, E = experts. Loads are routed (token, expert) assignments per
step, float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eaas.runtime.placement.placement import PlacementError

CALIBRATED_SIGMA = 0.71
"""Log-normal sigma giving max/mean ~2.5 for 256 experts on 64 servers (see module docstring)."""

_NUM_WAVES = 4


@dataclass(frozen=True)
class TraceConfig:
    """num_layers / num_experts: L, E. tokens_per_step: routed assignments per layer per step
    (e.g. 4096 tokens x top-8). popularity_sigma: sigma of the log-normal popularity.
    phases / phase_steps / switch_steps: workload phases, their length, the blend at a switch.
    shared_fraction: share of the popularity's log-variance common to all phases.
    drift_sigma / drift_steps: amplitude (in units of popularity_sigma) and time scale of the slow
    drift. resolution_steps: popularity is recomputed every this many steps. seed: everything
    random derives from it."""

    num_layers: int = 58
    num_experts: int = 256
    tokens_per_step: int = 32768
    popularity_sigma: float = CALIBRATED_SIGMA
    phases: tuple[str, ...] = ("chat", "code", "math")
    phase_steps: int = 2500
    switch_steps: int = 50
    shared_fraction: float = 0.5
    drift_sigma: float = 0.3
    drift_steps: int = 1000
    resolution_steps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "num_experts",
            "tokens_per_step",
            "phase_steps",
            "drift_steps",
            "resolution_steps",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise PlacementError(f"TraceConfig.{field} must be an int >= 1, got {value!r}")
        if not self.phases:
            raise PlacementError("TraceConfig.phases must name at least one phase")
        if not 0 <= self.switch_steps <= self.phase_steps:
            raise PlacementError("TraceConfig.switch_steps must be in 0..phase_steps")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise PlacementError("TraceConfig.shared_fraction must be in [0, 1]")
        if self.popularity_sigma < 0 or self.drift_sigma < 0:
            raise PlacementError("TraceConfig.popularity_sigma and drift_sigma must be >= 0")


class SyntheticTrace:
    """Deterministic: the same config gives the same loads for any step range, in any order."""

    def __init__(self, config: TraceConfig | None = None) -> None:
        self.config = config = config or TraceConfig()
        rng = np.random.default_rng([config.seed, 0])
        shape = (config.num_layers, config.num_experts)
        self._shared = rng.standard_normal(shape)
        self._phase = rng.standard_normal((len(config.phases), *shape))
        # Drift: sum of sinusoids with random periods (0.5x..2x drift_steps) and phases, scaled to
        # a stationary std of 1 (each sinusoid has variance a^2 / 2).
        self._periods = config.drift_steps * np.exp(
            rng.uniform(math.log(0.5), math.log(2.0), (_NUM_WAVES, *shape))
        )
        self._offsets = rng.uniform(0.0, 2 * math.pi, (_NUM_WAVES, *shape))
        self._amplitude = math.sqrt(2.0 / _NUM_WAVES)

    def phase_at(self, step: int) -> str:
        """Name of the workload phase at ``step``."""
        config = self.config
        return config.phases[(step // config.phase_steps) % len(config.phases)]

    def popularity(self, step: int) -> np.ndarray:
        """float64 ``[L, E]``: routing probabilities at ``step`` (rows sum to 1)."""
        config = self.config
        step = (step // config.resolution_steps) * config.resolution_steps
        phase_index = step // config.phase_steps
        logits = self._phase_logits(phase_index)
        into_phase = step - phase_index * config.phase_steps
        if phase_index > 0 and into_phase < config.switch_steps:
            blend = (into_phase + 1) / (config.switch_steps + 1)
            logits = blend * logits + (1 - blend) * self._phase_logits(phase_index - 1)
        angle = 2 * math.pi * step / self._periods + self._offsets
        drift = self._amplitude * np.sin(angle).sum(axis=0)
        logits = logits + config.popularity_sigma * config.drift_sigma * drift
        logits -= logits.max(axis=1, keepdims=True)
        weights = np.exp(logits)
        return weights / weights.sum(axis=1, keepdims=True)

    def _phase_logits(self, phase_index: int) -> np.ndarray:
        config = self.config
        phase = self._phase[phase_index % len(config.phases)]
        mixed = (
            math.sqrt(config.shared_fraction) * self._shared + math.sqrt(1 - config.shared_fraction) * phase
        )
        return config.popularity_sigma * mixed

    def expected_loads(self, start: int, stop: int) -> np.ndarray:
        """float32 ``[T, L, E]``: expected tokens per (layer, expert) for steps ``start..stop-1``."""
        self._check_range(start, stop)
        config = self.config
        out = np.empty((stop - start, config.num_layers, config.num_experts), dtype=np.float32)
        cached_key, cached = -1, np.empty(0)
        for i, step in enumerate(range(start, stop)):
            key = step // config.resolution_steps
            if key != cached_key:
                cached_key, cached = key, config.tokens_per_step * self.popularity(step)
            out[i] = cached
        return out

    def loads(self, start: int, stop: int) -> np.ndarray:
        """float32 ``[T, L, E]``: sampled tokens per (layer, expert) for steps ``start..stop-1``
        (expected load plus Gaussian noise of Poisson variance, clipped at 0)."""
        expected = self.expected_loads(start, stop)
        config = self.config
        for i, step in enumerate(range(start, stop)):
            rng = np.random.default_rng([config.seed, 1, step])
            noise = rng.standard_normal((config.num_layers, config.num_experts), dtype=np.float32)
            expected[i] += np.sqrt(expected[i]) * noise
        return np.maximum(expected, 0.0, out=expected)

    @staticmethod
    def _check_range(start: int, stop: int) -> None:
        if not (isinstance(start, int) and isinstance(stop, int)) or start < 0 or stop <= start:
            raise PlacementError(f"step range must satisfy 0 <= start < stop, got {start}..{stop}")
