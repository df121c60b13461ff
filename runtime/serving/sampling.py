"""Sampling parameters and the sampler: temperature, top-k, top-p, presence and frequency
penalties (OpenAI's definitions), per-request seeds, log-probabilities.

Reproducibility: each seeded request owns a ``torch.Generator`` and draws exactly one number per
generated token, so its tokens do not depend on what else is in the batch. Greedy decoding
(``temperature == 0``) takes the arg-max of the penalised logits.
Legend: B = sequences in the step, V = vocabulary, N = top alternatives reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; N: the chosen token's and the N most likely

    def __post_init__(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field}: {message}")

        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            fail("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                fail(field, f"must be in [-2, 2], got {getattr(self, field)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sampled:
    token: int
    logprob: float  # of the chosen token under the model's distribution
    top: list[tuple[int, float]]  # the N most likely (token, logprob), most likely first


def new_generator(params: SamplingParams) -> torch.Generator:
    """The generator a request draws from: seeded if asked, else from fresh entropy."""
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
    counts: list[torch.Tensor],  # per row [V] int64: how often each token was generated so far
) -> list[Sampled]:
    """One token per row. Log-probabilities are those of the model (before penalties,
    temperature and truncation), as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, V]
    out: list[Sampled] = []
    for row, p in enumerate(params):
        scores = logits[row].to(torch.float32)
        if p.presence_penalty or p.frequency_penalty:
            seen = counts[row].to(torch.float32)
            scores = scores - p.frequency_penalty * seen - p.presence_penalty * (seen > 0).float()
        token = int(torch.argmax(scores)) if p.greedy else _draw(scores / p.temperature, p, generators[row])
        top: list[tuple[int, float]] = []
        if p.logprobs:
            values, ids = torch.topk(logprobs[row], p.logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        out.append(Sampled(token, float(logprobs[row, token]), top))
    return out


def _draw(scores: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """scores [V] -> a token drawn after top-k and top-p truncation."""
    if p.top_k and p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
