"""folio.Tokenizer against the demo tokenizer (byte-level BPE) and hand-built SentencePiece-style tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from folio.demo import write_demo_model
from folio.tokenizer import Tokenizer, byte_level_char_to_byte

TEXTS = [
    "The lighthouse keeper climbed 112 steps.",
    "  leading spaces, trailing tabs\t\t\nand new\r\nlines\n\n",
    "naïve café — “quotes” ½",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 in one line",
    "日本語のテキストと中文文本",
    "",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_dir)


def concat_token_bytes(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


# ------------------------------------------------------------------------------------------ demo tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_token_bytes(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert concat_token_bytes(tok, ids) == text.encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_token_bytes_concatenate_to_decoded_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    decoded = tok.decode(ids)
    assert decoded == text
    assert concat_token_bytes(tok, ids) == decoded.encode("utf-8")


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    # The demo vocabulary has no merges for CJK or emoji, so their bytes arrive one token at a time; this is the
    # case token_bytes exists for (each token alone is not valid UTF-8).
    ids = tok.encode("🙂")
    assert len(ids) > 1
    assert tok.token_bytes(ids[0]) == "🙂".encode()[:1]
    assert tok.id_to_piece(ids[0]) == "\ufffd"


def test_token_bytes_agree_with_library_decode_for_every_token(tok: Tokenizer) -> None:
    checked = 0
    for token_id in range(tok.vocab_size):
        raw = tok.token_bytes(token_id)
        if token_id in tok.special_ids:
            assert raw == b""
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character; covered by the concatenation tests
        assert tok.decode([token_id]) == text, token_id
        assert tok.id_to_piece(token_id) == text
        checked += 1
    assert checked > 800  # everything but the 3 special tokens and the ~128 lone non-ASCII bytes


def test_special_tokens_in_text_are_plain_text_by_default(tok: Tokenizer) -> None:
    eos_id = tok.eos_token_ids[0]
    text = "end<|eos|>start"
    plain_ids = tok.encode(text)
    assert eos_id not in plain_ids
    assert tok.decode(plain_ids) == text
    assert concat_token_bytes(tok, plain_ids) == text.encode()

    special_ids = tok.encode(text, encode_special_tokens=True)
    assert special_ids.count(eos_id) == 1
    assert tok.decode(special_ids) == "endstart"
    assert tok.decode(special_ids, decode_special_tokens=True) == text
    assert tok.token_bytes(eos_id) == b""
    assert tok.id_to_piece(eos_id) == "<|eos|>"


def test_demo_special_ids_bos_eos_pad(tok: Tokenizer) -> None:
    assert tok.special_ids == frozenset({0, 1, 2})
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1,), 2)
    assert [tok.id_to_piece(i) for i in (0, 1, 2)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    assert tok.add_bos_token is True
    ids = tok.encode("hello", add_bos=True)
    assert ids[0] == 0 and ids[1:] == tok.encode("hello")


def test_vocab_size_and_padding(tok: Tokenizer) -> None:
    assert tok.vocab_size == 1000
    assert tok.padded_vocab_size == 1024
    with pytest.raises(ValueError, match="1000"):
        tok.token_bytes(1000)
    with pytest.raises(ValueError, match="-1"):
        tok.decode([5, -1])


def test_non_special_added_token_keeps_its_text(demo_dir: Path, tmp_path: Path) -> None:
    hf = HFTokenizer.from_file(str(demo_dir / "tokenizer.json"))
    hf.add_tokens([AddedToken("<sep>", special=False, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    sep_id = tok.encode("<sep>")
    assert len(sep_id) == 1 and sep_id[0] not in tok.special_ids
    assert tok.token_bytes(sep_id[0]) == b"<sep>"
    ids = tok.encode("a <sep> b")
    assert sep_id[0] in ids
    assert concat_token_bytes(tok, ids) == tok.decode(ids).encode() == b"a <sep> b"
    assert tok.vocab_size == 1001 and tok.padded_vocab_size == 1024


def test_byte_level_table_is_a_bijection() -> None:
    table = byte_level_char_to_byte()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["a"] == ord("a")


# ------------------------------------------------------------------------------------ ids from config files


def _model_dir(demo_dir: Path, tmp_path: Path, **files: dict) -> Path:
    shutil.copy(demo_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def test_eos_ids_are_the_union_of_all_config_files(demo_dir: Path, tmp_path: Path) -> None:
    path = _model_dir(
        demo_dir,
        tmp_path,
        tokenizer_config={"eos_token": {"content": "<|pad|>", "special": True}, "bos_token": None},
        generation_config={"eos_token_id": [1, 2], "bos_token_id": 0},
        config={"eos_token_id": 1, "bos_token_id": 2},
    )
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_ids == (2, 1)  # tokenizer_config's first, then generation_config, then config; no repeats
    assert tok.bos_token_id == 0  # generation_config before config
    assert tok.pad_token_id is None
    # no add_bos_token in tokenizer_config: follow the post-processor, which prepends <|bos|>
    assert tok.add_bos_token is True


def test_ids_from_config_json_alone(demo_dir: Path, tmp_path: Path) -> None:
    path = _model_dir(demo_dir, tmp_path, config={"eos_token_id": [1], "bos_token_id": 0, "pad_token_id": 2})
    tok = Tokenizer.from_pretrained(path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1,), 2)


def test_no_config_files_means_no_special_roles(demo_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_model_dir(demo_dir, tmp_path))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.add_bos_token) == (None, (), None, False)
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("x", add_bos=True)


def test_add_bos_token_false_in_tokenizer_config_wins(demo_dir: Path, tmp_path: Path) -> None:
    path = _model_dir(demo_dir, tmp_path, tokenizer_config={"bos_token": "<|bos|>", "add_bos_token": False})
    tok = Tokenizer.from_pretrained(path)
    assert tok.bos_token_id == 0 and tok.add_bos_token is False


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"tokenizer_config": {"eos_token": "<|nope|>"}}, r"tokenizer_config\.json: eos_token '<\|nope\|>'"),
        ({"tokenizer_config": {"bos_token": 7}}, r"tokenizer_config\.json: bos_token must be"),
        ({"tokenizer_config": {"add_bos_token": "yes"}}, r"tokenizer_config\.json: add_bos_token"),
        ({"generation_config": {"eos_token_id": "2"}}, r"generation_config\.json: eos_token_id must be"),
        ({"config": {"eos_token_id": [1, True]}}, r"config\.json: eos_token_id must be"),
        ({"config": {"eos_token_id": 5000}}, r"eos_token_ids 5000 is not a token id"),
    ],
)
def test_bad_config_values_name_the_file(demo_dir: Path, tmp_path: Path, files: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_pretrained(_model_dir(demo_dir, tmp_path, **files))


def test_malformed_json_names_the_file(demo_dir: Path, tmp_path: Path) -> None:
    path = _model_dir(demo_dir, tmp_path)
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        Tokenizer.from_pretrained(path)


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


# ------------------------------------------------------------------------------ SentencePiece-style vocabularies

SP_PIECES = ["<unk>", "<s>", "</s>", "▁", "▁h", "▁w", "h", "e", "l", "o", "w", "r", "d"]
SP_PIECES += ["ll", "llo", "▁hello", "é"]
SP_MERGES = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]


def _sentencepiece_tokenizer(path: Path, style: str) -> Tokenizer:
    """A tiny SentencePiece-like BPE: '▁' marks spaces, all 256 '<0xNN>' byte-fallback pieces, and either the
    Metaspace pre-tokenizer/decoder or the Llama-2 style normalizer + Replace/ByteFallback/Fuse/Strip decoder."""
    pieces = SP_PIECES + ["▁he"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=SP_MERGES, unk_token="<unk>", byte_fallback=True))
    if style == "metaspace":
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁")])
    else:
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        hf.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    hf.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_pretrained(path)


@pytest.mark.parametrize("style", ["metaspace", "llama2"])
@pytest.mark.parametrize("text", ["hello world", "hello 🙂 wörld", "héllo  world 日本", "hello\nworld"])
def test_sentencepiece_token_bytes(tmp_path: Path, style: str, text: str) -> None:
    tok = _sentencepiece_tokenizer(tmp_path, style)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # The first piece carries the prefix space that SentencePiece adds; decode strips it from the text's start,
    # but a generated token mid-text does contribute it, so token_bytes keeps it.
    assert concat_token_bytes(tok, ids) == b" " + text.encode("utf-8")


@pytest.mark.parametrize("style", ["metaspace", "llama2"])
def test_sentencepiece_pieces_bytes_and_special_tokens(tmp_path: Path, style: str) -> None:
    tok = _sentencepiece_tokenizer(tmp_path, style)
    piece_id = {tok.id_to_piece(i): i for i in range(tok.vocab_size) if i not in tok.special_ids}
    assert tok.token_bytes(piece_id[" hello"]) == b" hello"
    byte_f0 = len(SP_PIECES) + 1 + 0xF0
    assert tok.token_bytes(byte_f0) == b"\xf0"
    assert tok.id_to_piece(byte_f0) == "\ufffd"
    assert tok.special_ids == frozenset({1, 2})
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
    assert tok.token_bytes(1) == tok.token_bytes(2) == b""
    ids = tok.encode("hello</s>", encode_special_tokens=True)
    assert ids[-1] == 2 and concat_token_bytes(tok, ids) == b" hello"
    assert 2 not in tok.encode("hello</s>")
    assert tok.vocab_size == len(SP_PIECES) + 1 + 256 and tok.padded_vocab_size % 32 == 0


@pytest.mark.parametrize("style", ["metaspace", "llama2"])
def test_sentencepiece_added_token_keeps_its_leading_space(tmp_path: Path, style: str) -> None:
    # Decoders that strip the text's leading space would strip it from a lone added token too; mid-text it stays.
    _sentencepiece_tokenizer(tmp_path, style)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken(" zz", special=False, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    zz_id = hf.token_to_id(" zz")
    assert tok.token_bytes(zz_id) == b" zz"
    ids = tok.encode("hello zz world")
    assert zz_id in ids
    assert concat_token_bytes(tok, ids) == b" " + tok.decode(ids).encode()


def test_unsupported_decoder_is_a_clear_error(tmp_path: Path) -> None:
    hf = HFTokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("hi") == [1]
    with pytest.raises(ValueError, match="token_bytes supports"):
        tok.token_bytes(1)


def test_synthetic_tokenizer_reads_its_made_up_words():
    from folio import Tokenizer

    tokenizer = Tokenizer.synthetic(50, bos_token_id=3, eos_token_ids=[4, 5])
    assert tokenizer.vocab_size == 50 and tokenizer.bos_token_id == 3 and list(tokenizer.eos_token_ids) == [4, 5]
    assert tokenizer.decode([7, 12, 49]) == "t7 t12 t49"  # (text in: word pieces carry the metaspace, "\u2581t7")
