"""A new ``ExpertStack`` for a changed hosted set, reading only the experts that are new: from
peers that hold them (:mod:`eaas.runtime.server.peers`) where given, else from the checkpoint.

Legend: G = hosted groups (one per (layer, expert)), H = hidden, I = expert intermediate size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from eaas.runtime.model import CheckpointReader, ExpertStack
from eaas.runtime.model.expert_side import ExpertKey
from eaas.runtime.server.peers import PeerSource

log = logging.getLogger("eaas.server")


def load_experts(
    reader: CheckpointReader,
    pairs: Iterable[ExpertKey],
    dtype: torch.dtype | None = None,
    keep_fp8: bool = False,
    peers: PeerSource | None = None,
    progress: bool = False,
) -> tuple[ExpertStack, int]:
    """(stack of ``pairs``, how many came from peers): what ``ExpertStack.load`` gives, with the
    pairs that live peers hold fetched from them and the rest (and whatever a peer failed to
    deliver intact) read from the checkpoint."""
    wanted = sorted(set(pairs))
    if peers is None or not wanted:
        return ExpertStack.load(reader, wanted, dtype=dtype, progress=progress, keep_fp8=keep_fp8), 0
    ExpertStack.check_pairs(reader.config, wanted)  # before any peer is asked
    dt = ExpertStack.loaded_dtype(reader, wanted, dtype)
    block = ExpertStack.fp8_block(reader, keep_fp8)
    fetched = peers.fetch(reader.config, wanted, dt, block)
    rest = (
        ExpertStack.load(reader, fetched.missing, dtype=dt, progress=progress, keep_fp8=keep_fp8)
        if fetched.missing
        else None
    )
    if fetched.stack is not None:
        mib = fetched.stack.nbytes / 2**20
        log.info(
            "fetched %d experts from %d peer(s): %.1f MiB in %.2f s (%.2f GB/s); %d from the checkpoint",
            len(fetched.stack.pairs),
            sum(1 for n in fetched.given.values() if n),
            mib,
            fetched.seconds,
            fetched.stack.nbytes / max(fetched.seconds, 1e-9) / 1e9,
            len(fetched.missing),
        )
    if fetched.stack is None:
        assert rest is not None
        return rest, 0
    if rest is None:
        return fetched.stack, len(wanted)
    sources = {pair: (fetched.stack, group) for group, pair in enumerate(fetched.stack.pairs)}
    sources |= {pair: (rest, group) for group, pair in enumerate(rest.pairs)}
    stack = ExpertStack.gather(reader.config, wanted, [sources[p] for p in wanted], fetched.stack.w13.device)
    return stack, len(fetched.stack.pairs)


def restack(
    old: ExpertStack, reader: CheckpointReader, pairs: Iterable[ExpertKey], peers: PeerSource | None = None
) -> tuple[ExpertStack, int]:
    """(stack hosting exactly ``pairs``, number of pairs loaded: from peers or the checkpoint).

    Pairs ``old`` hosts are copied from its tensors (not re-read); only the others are loaded, in
    ``old``'s dtype and on its device, from `peers` that hold them where given. ``old`` is left
    untouched (the loop may still be using it). Raises ``ValueError`` for a pair that is not a
    routed expert of the model.
    """
    wanted = sorted(set(pairs))
    kept = {pair: group for group, pair in enumerate(old.pairs)}
    fp8 = old.scales is not None
    dtype = old.compute_dtype if fp8 else old.w13.dtype
    loaded, _ = load_experts(reader, [p for p in wanted if p not in kept], dtype, fp8, peers)
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
