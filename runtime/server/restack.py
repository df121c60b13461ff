"""A new ``ExpertStack`` for a changed hosted set, reading only the experts that are new.

Legend: G = hosted groups (one per (layer, expert)), H = hidden, I = expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Iterable

from eaas.runtime.model import CheckpointReader, ExpertStack
from eaas.runtime.model.expert_side import ExpertKey


def restack(
    old: ExpertStack, reader: CheckpointReader, pairs: Iterable[ExpertKey]
) -> tuple[ExpertStack, int]:
    """(stack hosting exactly ``pairs``, number of pairs read from the checkpoint).

    Pairs ``old`` hosts are copied from its tensors (not re-read); only the others are loaded, in
    ``old``'s dtype and on its device. ``old`` is left untouched (the loop may still be using it).
    Raises ``ValueError`` for a pair that is not a routed expert of the model.
    """
    wanted = sorted(set(pairs))
    kept = {pair: group for group, pair in enumerate(old.pairs)}
    fp8 = old.scales is not None
    dtype = old.compute_dtype if fp8 else old.w13.dtype
    loaded = ExpertStack.load(reader, [p for p in wanted if p not in kept], dtype=dtype, keep_fp8=fp8)
    fresh = {pair: group for group, pair in enumerate(loaded.pairs)}
    device = old.w13.device
    if not wanted:
        block = old.scales.block if old.scales is not None else None
        return ExpertStack.empty(old.config, 0, dtype, [], block).to(device), 0
    sources = [(old, kept[p]) if p in kept else (loaded, fresh[p]) for p in wanted]
    return ExpertStack.gather(old.config, wanted, sources, device), len(fresh)


def hosted_layers(stack: ExpertStack) -> frozenset[int]:
    """The layers with at least one expert in ``stack`` (requests for other layers are refused)."""
    return frozenset(layer for layer, _ in stack.pairs)
