"""Sampling parameters and the sampler: temperature, top-k, top-p, presence and frequency
penalties (OpenAI's definitions), per-request seeds, log-probabilities (of the tokens sampled, and
with ``score`` of a prompt's own tokens), and vLLM's ``min_tokens`` (a row's stop tokens are barred
until it has generated that many).

Reproducibility: each seeded request owns a ``torch.Generator`` and draws exactly one number per
generated token, so its tokens do not depend on what else is in the batch. Everything else is one
set of tensor operations over the batch (no per-row pass over the vocabulary). Greedy decoding
(``temperature`` below ``GREEDY_BELOW``, 0 included) takes the arg-max of the penalised logits. A
``top_k`` at or above the vocabulary keeps every token.
Legend: B = sequences in the step, T = prompt positions scored, V = vocabulary, N = top alternatives
reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
# vLLM's _SAMPLING_EPS: a temperature this small is greedy. Dividing float32 scores by it would give
# inf (or, below float32's range, a division by 0) and NaN probabilities, not a sharper distribution.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: nothing generated (the prompt goes through the model, to be scored)
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens (so is anything >= the vocabulary)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; N: the chosen token's and the N most likely
    min_tokens: int = 0  # the stop tokens (stop_token_ids, EOS among them) are barred before this many
    # None: none; N: each prompt token's (after the first) and the N most likely at its position
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field}: {message}")

        if self.max_tokens < 0:
            fail(
                "max_tokens",
                f"must be >= 0 (0: the prompt only, scored with prompt_logprobs), got {self.max_tokens}",
            )
        if not 0.0 <= self.temperature <= 2.0:
            fail("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                fail(field, f"must be in [-2, 2], got {getattr(self, field)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                fail(field, f"must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class Sampled:
    token: int
    logprob: float  # of the chosen token under the model's distribution
    top: list[tuple[int, float]]  # the N most likely (token, logprob), most likely first


@dataclass
class Scored:
    """A prompt token under the model's distribution at its position (vLLM's prompt logprobs)."""

    token: int
    logprob: float
    rank: int  # 1: the most likely; ties count against the token (as vLLM ranks)
    top: list[tuple[int, float]]  # the N most likely (token, logprob), most likely first


def score(
    logits: torch.Tensor,  # [T, V]: the logits at T positions
    tokens: torch.Tensor,  # [T] int64: the token that follows each position
    num_top: int,
) -> list[Scored]:
    """Each token's log-probability (the log-softmax of the logits before it), its rank and the
    ``num_top`` most likely tokens there."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [T, V]
    chosen = logprobs.gather(1, tokens.to(logprobs.device)[:, None])  # [T, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [T]
    top_values, top_ids = torch.topk(logprobs, num_top)  # [T, N]
    return [
        Scored(token, logprob, rank, list(zip(ids, values, strict=True)))
        for token, logprob, rank, ids, values in zip(
            tokens.tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            strict=True,
        )
    ]


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
    allowed: torch.Tensor | None = None,  # [B, V] bool: the tokens a row may take (structured outputs)
) -> list[Sampled]:
    """One token per row, the whole batch at once. Log-probabilities are those of the model
    (before penalties, temperature, truncation and a grammar's mask), as OpenAI reports them.
    A row of ``allowed`` must allow at least one token."""
    logits = logits.to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    scores = logits
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        seen = torch.stack(counts).to(torch.float32)  # [B, V]
        frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]
        presence = torch.tensor([p.presence_penalty for p in params])[:, None]
        scores = scores - frequency * seen - presence * (seen > 0).float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    barred = _early_stops(params, counts, scores.shape[1])
    if barred is not None:
        kept = scores.masked_fill(barred, float("-inf"))
        # a row left with no token (a grammar that allows only a stop token now) keeps its stops
        stuck = torch.isneginf(kept).all(dim=-1)  # [B]
        scores = torch.where(stuck[:, None], scores, kept)
    tokens = torch.argmax(scores, dim=-1)  # [B]: the greedy rows' answer
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        tokens[drawn] = _draw(scores[drawn], [params[r] for r in drawn], [generators[r] for r in drawn])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    most = max((p.logprobs or 0) for p in params)
    top_values, top_ids = torch.topk(logprobs, most) if most else (logprobs[:, :0], tokens[:, None][:, :0])
    out = []
    for row, (token, logprob, values, ids) in enumerate(
        zip(tokens.tolist(), chosen.tolist(), top_values.tolist(), top_ids.tolist(), strict=True)
    ):
        n = params[row].logprobs or 0
        out.append(Sampled(token, logprob, list(zip(ids[:n], values[:n], strict=True))))
    return out


def _early_stops(params: list[SamplingParams], counts: list[torch.Tensor], vocab: int) -> torch.Tensor | None:
    """[B, V] bool: the stop tokens of the rows that have generated fewer than ``min_tokens``
    (``counts[row]`` sums to the tokens it generated); None when no row bars any."""
    rows = [
        row
        for row, p in enumerate(params)
        if p.min_tokens and p.stop_token_ids and int(counts[row].sum()) < p.min_tokens
    ]
    if not rows:
        return None
    barred = torch.zeros(len(params), vocab, dtype=torch.bool)
    for row in rows:
        ids = [t for t in params[row].stop_token_ids if t < vocab]
        barred[row, ids] = True
    return barred


def _draw(
    scores: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """scores [b, V] -> one token per row, drawn after temperature, top-k and top-p.

    Inverse-CDF sampling: each row draws one uniform number from its own generator and lays it
    along its own order (vocabulary order, or most likely first where it truncates), so a seeded
    request's tokens do not depend on the rest of the batch."""
    vocab = scores.shape[1]
    cut = [bool((p.top_k and p.top_k < vocab) or p.top_p < 1.0) for p in params]
    if any(cut) and not all(cut):  # rows that truncate and rows that do not: each kind on its own
        tokens = torch.empty(len(params), dtype=torch.long)
        for kind in (True, False):
            rows = [i for i, c in enumerate(cut) if c == kind]
            tokens[rows] = _draw(scores[rows], [params[i] for i in rows], [generators[i] for i in rows])
        return tokens
    temperature = torch.tensor([p.temperature for p in params])[:, None]
    scores = scores / temperature
    truncated = all(cut)
    if truncated:  # most likely first, so top-k and top-p are prefixes
        scores, order = torch.sort(scores, dim=-1, descending=True)
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params])[:, None]
        scores = scores.masked_fill(torch.arange(vocab)[None, :] >= top_k, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if truncated:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p, 0.0)
    cdf = torch.cumsum(probs, dim=-1)  # [b, V]; a truncated row's mass is below 1
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators])  # [b]
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    # The first token whose cdf passes the draw has probability > 0; rounding at the very top is
    # caught by the last such token.
    last = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1, keepdim=True)
    position = torch.minimum(position, last)
    return order.gather(1, position)[:, 0] if truncated else position[:, 0]
