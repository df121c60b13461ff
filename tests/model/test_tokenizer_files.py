"""The byte tokenizer as Hugging Face files (``eaas model tokenizer``): what tools load by directory
must split text exactly as a preset's server does."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from eaas.runtime.cli import main
from eaas.runtime.model import ByteTokenizer, load_tokenizer, preset, write_byte_tokenizer

SAMPLES = ["", "hello world", "  leading spaces\tand tabs\n", "héllo wörld — 日本語 🙂", "<|id_300|> as text"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_tokenizer(tmp_path_factory.mktemp("tokenizer"), 512)


@pytest.fixture(scope="module")
def hf(directory: Path) -> object:
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("text", SAMPLES)
def test_auto_tokenizer_encodes_like_the_byte_tokenizer(hf: object, text: str) -> None:
    ids = hf.encode(text)  # type: ignore[attr-defined]
    assert ids == ByteTokenizer(320).encode(text) == list(text.encode("utf-8"))
    assert hf.decode(ids) == text  # type: ignore[attr-defined]


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_any_text_round_trips_through_both(hf: object, text: str) -> None:
    ids = hf.encode(text)  # type: ignore[attr-defined]
    assert ids == ByteTokenizer(320).encode(text)
    assert hf.decode(ids) == text  # type: ignore[attr-defined]


def test_ids_past_the_bytes_decode_to_nothing_as_on_the_server(hf: object) -> None:
    ids = [104, 300, 105, 256, 319]
    assert hf.decode(ids, skip_special_tokens=True) == ByteTokenizer(320).decode(ids) == "hi"  # type: ignore[attr-defined]
    assert hf.model_max_length == 512  # type: ignore[attr-defined]
    assert hf.eos_token is None and hf.bos_token is None  # type: ignore[attr-defined]


def test_the_servers_own_loader_reads_the_files_the_same_way(directory: Path) -> None:
    tokenizer = load_tokenizer(directory, 320)
    for text in SAMPLES:
        assert tokenizer.encode(text) == list(text.encode("utf-8"))
        assert tokenizer.decode([*tokenizer.encode(text), 300]) == text
    assert tokenizer.eos_token_ids == () and tokenizer.bos_id is None


def test_eaas_model_tokenizer_writes_a_presets_tokenizer(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "tokenizer", "qwen3_moe/tiny", str(tmp_path / "tok")])
    assert result.exit_code == 0, result.output
    config = preset("qwen3_moe", "tiny")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded.model_max_length == config.max_position_embeddings
    assert loaded.encode("héllo") == list("héllo".encode())


@pytest.mark.parametrize(
    ("spec", "message"),
    [("mixtral", "FAMILY/PRESET is needed"), ("mixtral/huge", "mixtral has tiny"), ("nope/tiny", "family")],
)
def test_a_bad_preset_is_named_with_the_choices(tmp_path: Path, spec: str, message: str) -> None:
    result = CliRunner().invoke(main, ["model", "tokenizer", spec, str(tmp_path / "tok")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "tok").exists()
