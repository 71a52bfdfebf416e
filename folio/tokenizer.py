"""Tokenizer: a Hugging Face `tokenizers` tokenizer plus the model's special-token metadata.

Loaded from a model directory: tokenizer.json (required), and where present tokenizer_config.json,
generation_config.json and config.json for bos/eos/pad ids.

`token_bytes(id)` gives the exact bytes one token contributes to the output text, which is what a streaming
detokenizer needs: a token may carry only part of a UTF-8 character (byte-level BPE, byte-fallback tokens), so
decoding token by token through `decode` would produce replacement characters. Two vocabulary styles are supported:
byte-level BPE (GPT-2 / Llama-3 / Qwen: each byte is written as one printable character) and SentencePiece-style
(U+2581 '▁' stands for a space, '<0xNN>' tokens carry one raw byte).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

VOCAB_PAD_MULTIPLE = 32


def byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table: printable bytes stand for themselves, the other 68 bytes
    (controls, space, 0x7f-0xa0, 0xad) are shifted to U+0100 upwards in byte order, so every byte is a visible
    character and the BPE never sees whitespace or control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    printable_set = set(printable)
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable_set:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(value).__name__}")
    return value


def _component_types(component: Any) -> list[dict[str, Any]]:
    """Flatten a tokenizer.json decoder (possibly a Sequence) into its list of parts."""
    if not isinstance(component, dict):
        return []
    if component.get("type") == "Sequence":
        parts: list[dict[str, Any]] = []
        for sub in component.get("decoders") or []:
            parts.extend(_component_types(sub))
        return parts
    return [component]


class Tokenizer:
    """Text <-> token ids for one model, with the model's bos/eos/pad ids and per-token output bytes."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None,
        add_bos_token: bool | None = None,
        source: str = "<memory>",
    ):
        self._source = source
        spec = json.loads(tokenizer_json)
        # Only what token_bytes needs later; the full JSON of a large vocabulary is not worth keeping.
        self._decoder_spec = spec.get("decoder")
        self._model_byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        self._hf = HFTokenizer.from_str(tokenizer_json)
        # A second instance that treats special tokens in the input as plain text. Two instances rather than
        # toggling the flag per call, so concurrent encodes from several threads never see each other's setting.
        self._hf_plain = HFTokenizer.from_str(tokenizer_json)
        self._hf_plain.encode_special_tokens = True

        vocab = self._hf.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        self.padded_vocab_size: int = -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
        added = self._hf.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)

        for name, token_id in (("bos_token_id", bos_token_id), ("pad_token_id", pad_token_id)):
            if token_id is not None:
                self._check_id(token_id, name)
        for token_id in eos_token_ids:
            self._check_id(token_id, "eos_token_ids")
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        # Whether prompts for this model conventionally start with bos (tokenizer_config's add_bos_token, else
        # what tokenizer.json's post-processor does). encode() only adds bos when asked; callers use this default.
        self.add_bos_token: bool = add_bos_token if add_bos_token is not None else self._post_processor_adds_bos()

        self._bytes_lock = threading.Lock()
        self._token_bytes: list[bytes] | None = None

    # ----------------------------------------------------------------------------------------------- loading

    @classmethod
    def synthetic(cls, vocab_size: int, bos_token_id: int = 0, eos_token_ids: Sequence[int] = (1,)) -> Tokenizer:
        """A word-level tokenizer over `vocab_size` made-up pieces (token i reads " t<i>"), for models of random
        weights (benchmarks, tests): the engine's text path runs for real, and no tokenizer files are needed."""
        vocab = {f"\u2581t{i}": i for i in range(vocab_size)}
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
            "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "\u2581t0"},
        }
        return cls(json.dumps(spec), bos_token_id=bos_token_id, eos_token_ids=list(eos_token_ids), pad_token_id=None)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (tokenizer.json required; configs optional)."""
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"tokenizer: model directory {model_dir} does not exist")
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"tokenizer: {tokenizer_path} not found (folio needs a Hugging Face fast-tokenizer file; "
                "convert a slow tokenizer with transformers' AutoTokenizer(...).save_pretrained first)"
            )
        tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
        hf = HFTokenizer.from_str(tokenizer_json)
        tok_cfg = _read_json(model_dir / TOKENIZER_CONFIG_FILE) or {}
        gen_cfg = _read_json(model_dir / GENERATION_CONFIG_FILE) or {}
        model_cfg = _read_json(model_dir / MODEL_CONFIG_FILE) or {}
        tok_cfg_path = model_dir / TOKENIZER_CONFIG_FILE

        def token_id_of(key: str) -> int | None:
            return _configured_token_id(hf, tok_cfg, key, tok_cfg_path)

        def config_ids(key: str) -> list[int]:
            return [
                *_config_ids(gen_cfg, key, model_dir / GENERATION_CONFIG_FILE),
                *_config_ids(model_cfg, key, model_dir / MODEL_CONFIG_FILE),
            ]

        # The tokenizer_config token first: it is what chat templates end a turn with.
        eos_ids = [i for i in [token_id_of("eos_token")] if i is not None] + config_ids("eos_token_id")
        bos_id = token_id_of("bos_token")
        if bos_id is None:
            bos_id = next(iter(config_ids("bos_token_id")), None)
        pad_id = token_id_of("pad_token")
        if pad_id is None:
            pad_id = next(iter(config_ids("pad_token_id")), None)
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"{tok_cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
        return cls(
            tokenizer_json,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            add_bos_token=add_bos,
            source=str(tokenizer_path),
        )

    def _check_id(self, token_id: int, name: str) -> None:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{self._source}: {name} {token_id!r} is not a token id in [0, {self.vocab_size})")

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self._hf.encode("", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    # ---------------------------------------------------------------------------------------- encode / decode

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what __init__ takes): another process builds the same one."""
        return self._hf.to_str()

    def encode(self, text: str, add_bos: bool = False, encode_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text in the input (e.g. "<|eos|>") becomes the special token only
        with encode_special_tokens=True; otherwise it is tokenized as the plain characters it consists of."""
        hf = self._hf if encode_special_tokens else self._hf_plain
        ids = hf.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"{self._source}: add_bos=True but the tokenizer has no bos token")
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens are dropped unless decode_special_tokens=True."""
        id_list = list(ids)
        for token_id in id_list:
            self._check_id(token_id, "token id")
        return self._hf.decode(id_list, skip_special_tokens=not decode_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """Text of one token as it reads mid-text ("▁the" -> " the"); special tokens give their own text.
        A token holding part of a UTF-8 character reads as U+FFFD here; use token_bytes for exact output."""
        self._check_id(token_id, "token id")
        if token_id in self.special_ids:
            return self._hf.id_to_token(token_id) or ""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes the token adds to the output mid-text (b"" for special tokens and unused ids)."""
        table = self._token_bytes
        if table is None:
            table = self._build_token_bytes()
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{self._source}: token id {token_id} is not in [0, {self.vocab_size})")
        return table[token_id]

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for, special tokens' own text included: a text of more than
        n x this many bytes encodes to more than n tokens."""
        table = self._token_bytes if self._token_bytes is not None else self._build_token_bytes()
        special = (len((self._hf.id_to_token(i) or "").encode("utf-8")) for i in self.special_ids)
        return max(max(map(len, table), default=0), max(special, default=0))

    # ------------------------------------------------------------------------------------------ byte table

    def _build_token_bytes(self) -> list[bytes]:
        with self._bytes_lock:
            if self._token_bytes is None:
                self._token_bytes = _TokenBytesBuilder(self).build()
            return self._token_bytes


class _TokenBytesBuilder:
    """Builds the per-token output bytes once, from tokenizer.json's decoder description."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        decoder_parts = _component_types(tok._decoder_spec)
        part_types = [p.get("type") for p in decoder_parts]
        self.byte_level = "ByteLevel" in part_types
        self.space_marker: str | None = None
        for part in decoder_parts:
            if part.get("type") == "Metaspace":
                self.space_marker = part.get("replacement", "▁")
            elif part.get("type") == "Replace" and part.get("content") == " ":
                pattern = part.get("pattern", {})
                self.space_marker = pattern.get("String") if isinstance(pattern, dict) else None
        self.byte_fallback = "ByteFallback" in part_types or tok._model_byte_fallback
        if not self.byte_level and self.space_marker is None:
            raise ValueError(
                f"{tok._source}: token_bytes supports byte-level BPE (ByteLevel decoder) and SentencePiece-style "
                f"vocabularies (Metaspace or Replace('▁', ' ') decoder); this decoder is {part_types or 'absent'}"
            )

    def build(self) -> list[bytes]:
        hf = self.tok._hf
        table = [b""] * self.tok.vocab_size
        char_to_byte = byte_level_char_to_byte() if self.byte_level else {}
        for piece, token_id in hf.get_vocab(with_added_tokens=False).items():
            if self.byte_level:
                table[token_id] = self._byte_level_bytes(piece, char_to_byte)
            else:
                table[token_id] = self._sentencepiece_bytes(piece)
        # Added tokens bypass the model's piece encoding; let the library decode the non-special ones, after an
        # ordinary anchor token so that decoders which strip a leading space from the text do not touch them.
        anchor_id = self._anchor_id(table)
        anchor_text = hf.decode([anchor_id]) if anchor_id is not None else ""
        for token_id in self.tok._added_ids - self.tok.special_ids:
            ids = [token_id] if anchor_id is None else [anchor_id, token_id]
            text = hf.decode(ids, skip_special_tokens=False)
            table[token_id] = text.removeprefix(anchor_text).encode("utf-8")
        for token_id in self.tok.special_ids:
            table[token_id] = b""
        return table

    @staticmethod
    def _byte_level_bytes(piece: str, char_to_byte: dict[str, int]) -> bytes:
        try:
            return bytes(char_to_byte[c] for c in piece)
        except KeyError:
            # Same rule as the library's ByteLevel decoder: a piece with a character outside the table is
            # written out as its own UTF-8.
            return piece.encode("utf-8")

    def _sentencepiece_bytes(self, piece: str) -> bytes:
        if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        assert self.space_marker is not None
        return piece.replace(self.space_marker, " ").encode("utf-8")

    def _anchor_id(self, table: list[bytes]) -> int | None:
        for letter in "aeiostnx":
            for token_id, piece_bytes in enumerate(table):
                if piece_bytes == letter.encode() and token_id not in self.tok._added_ids:
                    if self.tok._hf.decode([token_id]) == letter:
                        return token_id
        return None


def _configured_token_id(hf: HFTokenizer, tok_cfg: dict[str, Any], key: str, cfg_path: Path) -> int | None:
    """Id of tokenizer_config's `key` token (a string, or an AddedToken dict with "content"), if set."""
    value = tok_cfg.get(key)
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{cfg_path}: {key} must be a string or an object with 'content', got {tok_cfg[key]!r}")
    token_id = hf.token_to_id(value)
    if token_id is None:
        raise ValueError(f"{cfg_path}: {key} {value!r} is not in the vocabulary of tokenizer.json")
    return token_id


def _config_ids(cfg: dict[str, Any], key: str, cfg_path: Path) -> list[int]:
    """`key` of a config file as a list of ids: accepts an int, a list of ints, or null/absent."""
    value = cfg.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{cfg_path}: {key} must be an int or a list of ints, got {value!r}")
    return list(values)
