"""Tokenizers: the checkpoint's own (``tokenizer.json``, through the ``tokenizers`` library) or,
for random checkpoints that have none, a byte-level one (token id = byte value; ids >= 256
decode to nothing). ``load_tokenizer`` picks.

Special tokens are kept out of decoded text, except the *markers* the server's chat formats read
(``Tokenizer.keep``: gpt-oss's ``<|channel|>``, Kimi-K2's ``<|tool_call_begin|>``, any
``<think>`` a tokenizer declares special): their text stays, so the parsers can find it.

Both decode whole id lists; streaming callers (``serving/text_stream.py``) decode a short window
of the growing list and hold back a trailing U+FFFD, so a character split over several tokens is
released only once complete.

``write_byte_tokenizer`` writes the byte tokenizer as Hugging Face files (``tokenizer.json`` and
``tokenizer_config.json``), for tools that load a tokenizer by directory (``AutoTokenizer``):
they then count and split text exactly as a random checkpoint's server does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # generation stops on these (the checkpoint's end-of-sequence ids)
    bos_id: int | None  # the id ``encode`` puts first (None: it puts none)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; with ``skip_special_tokens`` false, special tokens as their text."""
        ...

    def marker_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose text is `text`, if there is one:
        grammars write such a marker as its token (llguidance's lexer spells no added token)."""
        ...

    def keep(self, markers: Iterable[str]) -> None:
        """From now on, the special tokens among `markers` decode to their text."""
        ...


class ByteTokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size: the byte tokenizer needs >= 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = ()
        self.bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")  # none special

    def marker_id(self, text: str) -> int | None:
        return None  # every id that decodes to text is a byte

    def keep(self, markers: Iterable[str]) -> None:
        pass  # no special tokens


class HFTokenizer:
    """``tokenizer.json`` of a checkpoint; special tokens are kept out of decoded text, but for
    `markers`."""

    def __init__(self, directory: Path, vocab_size: int, markers: Iterable[str] = ()) -> None:
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(directory / "tokenizer.json"))
        self.vocab_size = vocab_size
        added = self.backend.get_added_tokens_decoder()
        self.added = {token.content: i for i, token in added.items()}
        self.specials = frozenset(i for i, token in added.items() if token.special)
        self.dropped: frozenset[int] | None = None  # None: drop every special token
        self.keep(markers)
        config = _read_json(directory / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos_ids = [self.backend.token_to_id(self.eos_token)] if self.eos_token else []
        generation = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos_ids += (
            generation if isinstance(generation, list) else [generation] if generation is not None else []
        )
        self.eos_token_ids = tuple(sorted({i for i in eos_ids if isinstance(i, int)}))
        self.add_bos = bool(config.get("add_bos_token", False))
        bos = self.backend.token_to_id(self.bos_token) if self.add_bos and self.bos_token else None
        self.bos_id: int | None = bos

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return list(ids)  # ids past the model's vocabulary are refused by the engine, naming the prompt

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return str(self.backend.decode(ids, skip_special_tokens=False))
        if self.dropped is None:
            return str(self.backend.decode(ids, skip_special_tokens=True))
        return str(self.backend.decode([i for i in ids if i not in self.dropped], skip_special_tokens=False))

    def marker_id(self, text: str) -> int | None:
        return self.added.get(text)

    def keep(self, markers: Iterable[str]) -> None:
        kept = {self.added[m] for m in markers if self.added.get(m) in self.specials}
        self.dropped = self.specials - kept if kept else None


# Tokenizer files of other kinds: a checkpoint that ships one of these and no tokenizer.json is
# refused, not served with the byte tokenizer (which would answer noise).
OTHER_TOKENIZERS = ("tiktoken.model", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def load_tokenizer(directory: str | Path, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer if it ships ``tokenizer.json``, else the byte tokenizer (random
    checkpoints have none). ``ValueError`` for a checkpoint whose tokenizer is of another kind."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory, vocab_size)
    other = [name for name in OTHER_TOKENIZERS if (directory / name).is_file()]
    if other:
        raise ValueError(
            f"{directory}: the tokenizer is {other[0]}, which this server cannot read; it needs "
            "tokenizer.json (transformers writes one: AutoTokenizer.from_pretrained(DIR)"
            ".save_pretrained(DIR), where the tokenizer converts to a fast one)"
        )
    return ByteTokenizer(vocab_size)


BYTE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> character table of byte-level BPE: printable bytes stand for themselves, the
    others for characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def write_byte_tokenizer(directory: str | Path, max_length: int) -> Path:
    """Write the byte tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` in `directory`
    (created if missing; returned): a byte-level BPE without merges whose token for byte b has id
    b, so it encodes text to its UTF-8 bytes. It has only those 256 tokens: the model's ids past
    them decode to nothing, as on the server (a tokenizer does not look ids it lacks up). No BOS,
    EOS or chat template: the byte tokenizer has none. `max_length` is the model's context
    (``model_max_length``, to which tools truncate prompts)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {char: byte for byte, char in byte_level_chars().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def chat_template(directory: str | Path) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: the ``default`` one)."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = _read_json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_tokens(directory: str | Path) -> dict[str, str]:
    """bos/eos token texts from ``tokenizer_config.json`` (templates refer to them)."""
    config = _read_json(Path(directory) / "tokenizer_config.json")
    return {k: t for k in ("bos_token", "eos_token") if (t := _token_text(config.get(k)))}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} as some configs write it
        token = token.get("content")
    return token if isinstance(token, str) else None
