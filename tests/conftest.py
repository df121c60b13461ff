"""Shared fixtures: tiny random checkpoints, written once per session, and small trained
tokenizers."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from eaas.runtime.model import FAMILIES, preset, write_random_checkpoint

REPOSITORY = Path(__file__).resolve().parents[1]


def _import_outside_the_repository(name: str) -> None:
    """Imports the installed distribution `name` with the repository root off ``sys.path``.

    ``python -m pytest`` (and pytest, for the ``e2e`` package) puts the repository root on
    ``sys.path``, where ``kernels/`` (the source of ``eaas.kernels``) would shadow the ``kernels``
    distribution that transformers imports (Hugging Face's hub kernels): transformers then fails
    with ``ImportError: cannot import name 'CUDAProperties' from 'kernels'``. Imported once from
    site-packages, the module is what every later ``import kernels`` gets."""
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPOSITORY]
    try:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved


_import_outside_the_repository("kernels")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of a tiny random checkpoint (sharded, so the index path is exercised)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        family: write_random_checkpoint(preset(family), root / family, seed=7, max_shard_bytes=256 * 1024)
        for family in FAMILIES
    }


def bpe_tokenizer(corpus: Iterable[str], special: Iterable[str] = (), added: Iterable[str] = ()) -> Any:
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) of 300 ids trained on `corpus`, with
    ``<unk>``, ``<s>`` and ``</s>``, then the `special` tokens and the (non-special) `added` ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(corpus), trainer)
    tokenizer.add_special_tokens(list(special))
    tokenizer.add_tokens([AddedToken(text, special=False) for text in added])
    return tokenizer


@pytest.fixture(scope="session")
def train_tokenizer() -> Any:
    """``bpe_tokenizer``, for test modules in any folder."""
    return bpe_tokenizer


FAILING_SEED = 666  # a request with this seed makes its sampling step fail (``failing_sampler``)


@pytest.fixture
def failing_sampler(monkeypatch: pytest.MonkeyPatch) -> int:
    """The serving engine's sampler raises, as a bug would, for any step that samples a request
    seeded ``FAILING_SEED`` (returned); other steps sample as usual."""
    from eaas.runtime.serving import engine

    real_sample = engine.sample

    def sample(logits: Any, params: Any, *rest: Any) -> Any:
        if any(p.seed == FAILING_SEED for p in params):
            raise ValueError("a bug in the sampler")
        return real_sample(logits, params, *rest)

    monkeypatch.setattr(engine, "sample", sample)
    return FAILING_SEED
