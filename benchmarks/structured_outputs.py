"""Structured outputs: what a grammar costs, measured against the same work without one, same run.

Part A, the engine: a tiny random model (the reference decoder in process) decodes ``--seqs``
sequences of ``--tokens`` tokens, sampled, three ways: no grammar, half the rows under a JSON
schema, every row under it, interleaved over ``--rounds`` rounds. Reported: the median generated
tokens per second of each and its ratio to the unconstrained run. The schema's one string field must
be 4000 characters long, so no row finishes early.

Part B, the mask alone: ``grammar.allowed_tokens`` (llguidance's parallel fill and our unpacking)
for vocabularies of the sizes real models have (32k, 128k, 200k), built from random printable
tokens of 1–8 bytes plus every single byte, along a path of tokens the grammar allows, at batch 1
and batch 16. Reported: microseconds per row per token. The llguidance authors' figure is ~50 µs
per token at a 128k vocabulary; there is no target on this machine's numbers, which a shared
2-core machine makes noisy.

Usage: python benchmarks/structured_outputs.py [--quick] [--json-out PATH]
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, parser, target

from eaas.runtime.model import ByteTokenizer, load_reference, write_random_checkpoint
from eaas.runtime.model.presets import preset
from eaas.runtime.serving.engine import Engine, EngineOptions
from eaas.runtime.serving.grammar import (
    Constraint,
    Grammars,
    allowed_tokens,
    load_llguidance,
    parse_constraint,
)
from eaas.runtime.serving.sampling import SamplingParams

NOTE = {
    "type": "object",
    "properties": {
        "title": {"enum": ["a", "b"]},
        "body": {"type": "string", "minLength": 4000, "maxLength": 4000},
    },
    "required": ["title", "body"],
    "additionalProperties": False,
}


def engine_run(decoder: Any, grammars: Grammars, seqs: int, tokens: int, constrained: int) -> dict[str, Any]:
    constraint = parse_constraint({"structured_outputs": {"json": NOTE, "disable_any_whitespace": True}})
    assert constraint is not None
    engine = Engine(decoder, EngineOptions(kv_cache_bytes=64 << 20, max_batch_tokens=4096, max_seqs=seqs))
    prompt = [ord(c) for c in "Write a note as JSON: "]
    rows = []
    for i in range(seqs):
        matcher = grammars.matcher(constraint) if i < constrained else None
        rows.append(engine.add(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i), matcher))
    engine.step()  # the prefill, not timed
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.output) for r in rows) - seqs  # the prefill's token is not timed
    early = sum(1 for r in rows if len(r.output) < tokens)
    return {
        "constrained_rows": constrained,
        "tokens": generated,
        "seconds": elapsed,
        "tok_per_s": generated / elapsed,
        "finished_early": early,
    }


class RandomVocabulary:
    """A vocabulary of ``size`` tokens: the 256 bytes, then random printable strings of 1-8 bytes."""

    def __init__(self, size: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        alphabet = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:;"{}[]_-'
        seen = {bytes([i]) for i in range(256)}
        tokens = [bytes([i]) for i in range(256)]
        while len(tokens) < size - 1:
            token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
            if token not in seen:
                seen.add(token)
                tokens.append(token)
        self.tokens = [*tokens, b"<eos>"]
        self.eos_token_id = size - 1
        self.bos_token_id = None
        self.special_token_ids = [size - 1]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


def mask_run(vocab: int, batch: int, steps: int) -> dict[str, Any]:
    llg = load_llguidance()
    tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(RandomVocabulary(vocab)), n_vocab=vocab)
    constraint = parse_constraint({"structured_outputs": {"json": NOTE}})
    assert isinstance(constraint, Constraint)
    template = llg.LLMatcher(tokenizer, constraint.grammar, log_level=0)
    matchers = [template.deep_copy() for _ in range(batch)]
    rng = random.Random(1)
    allowed_tokens(matchers, vocab)  # warm the executor
    matchers = [template.deep_copy() for _ in range(batch)]
    spent, done = 0.0, 0
    for _ in range(steps):
        start = time.perf_counter()
        masks = allowed_tokens(matchers, vocab)
        spent += time.perf_counter() - start
        done += len(matchers)
        live = []
        for matcher, mask in zip(matchers, masks, strict=True):
            choices = mask.nonzero().flatten().tolist()
            matcher.consume_token(rng.choice(choices))
            if not matcher.is_stopped():
                live.append(matcher)
        matchers = live or [template.deep_copy() for _ in range(batch)]
    return {"vocab": vocab, "batch": batch, "us_per_row_token": spent / done * 1e6}


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5, help="runs of each mode (the median is reported)")
    args = p.parse_args()
    if args.quick:
        args.seqs, args.tokens, args.rounds = 8, 32, 3
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(preset("mixtral"), Path(tmp) / "m", seed=7)
        decoder = load_reference(checkpoint)
        grammars = Grammars(ByteTokenizer(decoder.config.vocab_size), decoder.config.vocab_size)
        runs = [
            engine_run(decoder, grammars, args.seqs, args.tokens, n) for n in (0, args.seqs // 2, args.seqs)
        ]
    free = runs[0]["tok_per_s"]
    print(f"Part A: {args.seqs} sequences x {args.tokens} tokens, tiny mixtral, sampled")
    print(f"{'constrained rows':>17} {'tokens':>7} {'tok/s':>9} {'vs none':>8} {'ended early':>12}")
    for run in runs:
        run["ratio"] = run["tok_per_s"] / free
        print(
            f"{run['constrained_rows']:>17} {run['tokens']:>7} {run['tok_per_s']:>9.1f} "
            f"{run['ratio']:>7.2f}x {run['finished_early']:>12}"
        )
    sizes = (32_000,) if args.quick else (32_000, 128_000, 200_000)
    masks = [mask_run(v, b, 24 if args.quick else 64) for v in sizes for b in (1, 16)]
    print("Part B: the mask alone (llguidance fill + unpacking), JSON schema, random vocabulary")
    print(f"{'vocab':>8} {'batch':>6} {'us/row/token':>13}")
    for m in masks:
        print(f"{m['vocab']:>8} {m['batch']:>6} {m['us_per_row_token']:>13.1f}")
    results = [{"part": "engine", **r} for r in runs] + [{"part": "mask", **m} for m in masks]
    targets = {
        # Every row constrained must keep most of the unconstrained rate on this tiny model, where
        # the model's own step is cheapest (a real model's step is far longer than a mask).
        "all_rows_constrained_vs_none": target(runs[-1]["ratio"], 0.5),
        "no_row_ended_early": target(
            float(sum(r["finished_early"] for r in runs)), 0.0, higher_is_better=False
        ),
    }
    emit("structured_outputs", results, targets, args.json_out)


if __name__ == "__main__":
    main()
