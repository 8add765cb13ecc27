"""The rebuilt Qwen tokenizer files and the runtime wrapper: parity with transformers and tiktoken."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qvl.processing.tokenizer import (
    ADDED_TOKENS,
    PRETOKENIZE_REGEX,
    StreamDecoder,
    Tokenizer,
    default_tiktoken_path,
    load_tiktoken_ranks,
)

CORPUS = [
    "",
    "Hello, world!",
    "你好",
    "The quick brown fox jumps over the lazy dog. It's 12:45, we've 3.14159 apples; they'll do.",
    "I'M SHOUTING, YOU'RE NOT, HE'D SAY",
    "人工智能正在改变世界。我们今天讨论：大语言模型、视觉理解和光学字符识别（OCR）！",
    "日本語のテキスト、カタカナとひらがな。한국어 문장입니다.",
    "Привет, мир! مرحبا بالعالم. नमस्ते दुनिया",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 2 == 0]  # squares\n\n\nclass A:\n\tpass\r\n",
    'fn main() { println!("{}", 1_000_000u64); } // rust\n{"key": [1, 2, {"n": null}]}',
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🫠 ✨",
    "rare CJK: 𠀀𪚥𰻞 and math: ∀x∈ℝ, x² ≥ 0 ≈ ∞ → ∑",
    "   leading spaces, trailing spaces    ",
    "a  b   c    d\t\te\n\n\nf \n \n g\r\n\r\nh      \n",
    "\n\n\n\n",
    "     ",
    "combining: e\u0301 n\u0303 A\u030a (NFC composes these) and ﬁ ligature, Å",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer<tool_call>\n{\"name\": \"f\"}\n</tool_call><|endoftext|>",
    "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe.<|video_pad|><|fim_prefix|>x<|fim_suffix|>",
    "almost special: <|im_start <im_end|> <|unknown|> <tool_call",
    "0123456789 1,000,000 2024-01-01 v1.2.3 0x1F 1e-9",
    "URL https://example.com/path?q=1&r=%20 and email a.b@c.de",
]


@pytest.fixture(scope="session")
def tok_dir(tokenizer_dir):
    return tokenizer_dir


@pytest.fixture(scope="session")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="session")
def ranked():
    return load_tiktoken_ranks(default_tiktoken_path())


@pytest.fixture(scope="session")
def tiktoken_enc(ranked):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {token: rank for rank, token in enumerate(ranked)}
    return tiktoken.Encoding("qwen", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens={})


@pytest.fixture(scope="session")
def hf_tokenizers(tok_dir):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    return auto, fast


# --- the files -------------------------------------------------------------------------


def test_known_encodings(tok):
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.encode("你好") == [108386]
    assert tok.decode([9707, 11, 1879, 0]) == "Hello, world!"


def test_files_match_official_layout(tok_dir, ranked):
    assert len(ranked) == 151643
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is False and model["byte_fallback"] is False
    assert model["dropout"] is None and model["unk_token"] is None and model["fuse_unk"] is False
    assert len(model["vocab"]) == 151643 and sorted(model["vocab"].values()) == list(range(151643))
    assert len(model["merges"]) == 151643 - 256  # one merge per multi-byte token
    assert model["merges"][:4] == [["Ġ", "Ġ"], ["ĠĠ", "ĠĠ"], ["i", "n"], ["Ġ", "t"]]
    assert tj["normalizer"] == {"type": "NFC"}
    split, byte_level = tj["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == PRETOKENIZE_REGEX and split["behavior"] == "Isolated"
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    assert tj["decoder"]["type"] == tj["post_processor"]["type"] == "ByteLevel"
    added = [(t["id"], t["content"], t["special"]) for t in tj["added_tokens"]]
    assert added == [(151643 + i, c, s) for i, (c, s) in enumerate(ADDED_TOKENS)]
    assert added[2] == (151645, "<|im_end|>", True) and added[12] == (151655, "<|image_pad|>", True)
    assert added[-1] == (151668, "</think>", False)

    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert cfg["model_max_length"] == 262144 and cfg["split_special_tokens"] is False
    assert cfg["added_tokens_decoder"]["151667"] == {
        "content": "<think>", "lstrip": False, "normalized": False,
        "rstrip": False, "single_word": False, "special": False,
    }  # fmt: skip

    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    assert vocab == model["vocab"]
    lines = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2" and lines[1:] == [f"{a} {b}" for a, b in model["merges"]]


def test_runtime_wrapper(tok):
    assert tok.vocab_size == 151669
    assert tok.token_id("<|image_pad|>") == 151655 and tok.token_id("<|im_end|>") == 151645
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    with pytest.raises(ValueError, match="not_a_token"):
        tok.token_id("<|not_a_token|>")
    ids = tok.encode("<|im_start|>user\nhi<think><|im_end|>")
    assert ids[0] == 151644 and ids[-2:] == [151667, 151645]
    assert tok.decode(ids) == "user\nhi<think>"  # <think> is not special, so it survives skipping
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<think><|im_end|>"


# --- parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_parity_with_transformers(tok, hf_tokenizers, text):
    ids = tok.encode(text)
    for hf in hf_tokenizers:
        assert hf.encode(text, add_special_tokens=False) == ids
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", [t for t in CORPUS if "<" not in t])
def test_parity_with_tiktoken(tok, tiktoken_enc, text):
    text = unicodedata.normalize("NFC", text)  # tiktoken does not normalise
    assert tok.encode(text) == tiktoken_enc.encode_ordinary(text)


def test_every_vocab_entry_encodes_like_tiktoken(tok, tiktoken_enc, ranked):
    # Each token's own text, encoded both ways: exercises every merge once.
    texts = []
    for token in ranked:
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if unicodedata.normalize("NFC", text) == text:
            texts.append(text)
    assert len(texts) > 149_000
    mismatched = [t for t in texts if tok.encode(t) != tiktoken_enc.encode_ordinary(t)]
    assert mismatched == []


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_random_text_matches_tiktoken(tok, tiktoken_enc, text):
    text = unicodedata.normalize("NFC", text)
    ids = tok.encode(text)
    if not any(special in text for special, _ in ADDED_TOKENS):
        assert ids == tiktoken_enc.encode_ordinary(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


# --- streaming -------------------------------------------------------------------------


def _stream(tok, ids, skip):
    decoder = StreamDecoder(tok, skip_special_tokens=skip)
    deltas = [decoder.push(i) for i in ids]
    return deltas, decoder.flush()


def test_stream_holds_back_split_characters(tok):
    ids = tok.encode("a 𪚥 b")  # the rare CJK character is split into byte tokens
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    deltas, tail = _stream(tok, ids, True)
    assert all("\ufffd" not in d for d in deltas) and tail == ""
    assert "".join(deltas) == "a 𪚥 b"
    assert "𪚥" in deltas  # emitted whole, the moment its last byte arrives


def test_stream_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 𪚥")
    deltas, tail = _stream(tok, ids[:-1], True)  # cut inside the character
    assert "".join(deltas) + tail == tok.decode(ids[:-1])
    assert "\ufffd" not in "".join(deltas) and tail.endswith("\ufffd")


def test_stream_skips_special_tokens(tok):
    ids = tok.encode("hi<|im_end|>") + [151643]
    assert _stream(tok, ids, True) == (["hi", "", ""], "")
    assert "".join(_stream(tok, ids, False)[0]) == "hi<|im_end|><|endoftext|>"


# Ids that split characters: single bytes (incl. lone continuation / lead bytes), pieces
# of emoji and rare CJK, ordinary words, and the added tokens.
_PIECES = "😀👍🏽👨‍👩‍👧 𪚥𠀀𰻞 你好世界 é ok the\n"


@st.composite
def _id_sequences(draw):
    parts = draw(
        st.lists(
            st.one_of(
                st.text(st.sampled_from(_PIECES), min_size=1, max_size=8).map(lambda s: ("text", s)),
                st.integers(0, 255).map(lambda i: ("id", i)),  # the 256 single-byte tokens
                st.integers(151643, 151668).map(lambda i: ("id", i)),
                st.integers(0, 151668).map(lambda i: ("id", i)),
            ),
            max_size=12,
        )
    )
    return parts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_id_sequences(), st.booleans())
def test_stream_decoder_property(tok, parts, skip):
    ids = []
    for kind, value in parts:
        ids.extend(tok.encode(value) if kind == "text" else [value])
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas, tail = _stream(tok, ids, skip)
    assert "".join(deltas) + tail == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas + [tail])
    if skip:
        specials = {c for c, special in ADDED_TOKENS if special}
        for token_id, delta in zip(ids, deltas):
            if token_id >= 151643 and ADDED_TOKENS[token_id - 151643][0] in specials:
                assert delta == ""


def test_stream_window_stays_small(tok):
    ids = tok.encode("word " * 3000)
    decoder = StreamDecoder(tok)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "word " * 3000
    decoder = StreamDecoder(tok)
    for i in ids:
        decoder.push(i)
    assert len(decoder._ids) <= 1100 and decoder._read_offset - decoder._prefix_offset <= 1
    for _ in range(5000):  # skipped special tokens do not grow the window either
        assert decoder.push(151643) == ""
    assert len(decoder._ids) <= 1100 and decoder._read_offset - decoder._prefix_offset <= 1
