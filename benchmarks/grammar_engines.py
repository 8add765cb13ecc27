"""Constrained-decoding engines side by side on qvl's real vocabulary: llguidance, xgrammar,
outlines-core. Not a qvl test: the engines are not qvl dependencies (except llguidance), so
install them apart and put them on the path:

    .venv/bin/pip install --target /tmp/gram llguidance==1.9.1 xgrammar==0.2.9 \\
        outlines-core==0.2.14 apache-tvm-ffi --no-deps
    PYTHONPATH=/tmp/gram .venv/bin/python benchmarks/grammar_engines.py --model /work/ckpt/qvl-2b

What it measures (torch.set_num_threads(--threads), every engine and grammar in a fresh
subprocess so "cold" is cold, under --mem-limit-gb and --timeout):

  setup     import time, whether torch / transformers get imported, tokenizer-info build
            (from tokenizer.json without transformers, and through AutoTokenizer)
  compile   an invoice JSON schema (~20 fields, nested line items, enum, date format, pattern,
            optional fields, additionalProperties false) compiled cold and again, each up to
            its first mask; also the same schema without maxLength/maxItems ("invoice-lite",
            which outlines-core can compile) and {"type": "object"} ("json_object")
  per token a greedy walk over random logits (torch.randn [1, V] float32, masked, argmax)
            until EOS or --tokens: mask fill, mask application (the engine's own kernel, and
            two engine-free ones: eager torch and numpy.unpackbits), advance; median/p90/max µs
  state     clone/fork of a matcher mid-answer, rollback of 10 tokens, new matcher from the
            compiled grammar
  threads   whether mask fill / advance release the GIL (gil_probe), one against two threads
            replaying the walk, and what a background replay does to a torch GEMV loop
  apply     the mask-application kernels alone on synthetic masks
  coverage  JSON-Schema keywords: accepted and enforced, rejected, or silently ignored
            (valid instances must be accepted, invalid ones rejected); invalid schemas;
            Lark, GBNF and regex grammars; a case that kills its worker (out of memory) is
            reported and the rest run again without it

The machine should be otherwise idle: --wait-idle N waits up to N s before each timed worker,
and the compile table shows other processes' CPU share before / during each one.
Output: tables on stdout; --json PATH keeps the raw results, --from-json A,B prints them again.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import threading
import time
import traceback

ENGINES = ("llguidance", "xgrammar", "outlines-core")
EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
MARK = "@@RESULT@@"

# ---------------------------------------------------------------------------------------
# Schemas and grammars
# ---------------------------------------------------------------------------------------

PARTY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "tax_id": {"type": ["string", "null"], "maxLength": 32},
        "address": {"type": "string", "maxLength": 128},
        "email": {"type": "string", "maxLength": 64},
    },
    "required": ["name"],
    "additionalProperties": False,
}

INVOICE = {
    "title": "Invoice",
    "$defs": {"party": PARTY},
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{4,8}$"},
        "issue_date": {"type": "string", "format": "date"},
        "due_date": {"type": "string", "format": "date"},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "CNY", "JPY"]},
        "status": {"type": "string", "enum": ["draft", "sent", "paid", "overdue"]},
        "vendor": {"$ref": "#/$defs/party"},
        "customer": {"$ref": "#/$defs/party"},
        "purchase_order": {"type": "string", "maxLength": 32},
        "line_items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 128},
                    "sku": {"type": "string", "maxLength": 32},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit": {"type": "string", "enum": ["pcs", "h", "kg", "m"]},
                    "unit_price": {"type": "number"},
                    "tax_rate": {"type": "number", "minimum": 0, "maximum": 1},
                    "amount": {"type": "number"},
                },
                "required": ["description", "quantity", "unit_price", "amount"],
                "additionalProperties": False,
            },
        },
        "subtotal": {"type": "number"},
        "discount": {"type": "number", "minimum": 0},
        "tax_total": {"type": "number"},
        "shipping": {"type": "number"},
        "total": {"type": "number"},
        "amount_paid": {"type": "number"},
        "balance_due": {"type": "number"},
        "payment_terms": {"type": "string", "maxLength": 64},
        "notes": {"type": "string", "maxLength": 256},
        "is_recurring": {"type": "boolean"},
    },
    "required": ["invoice_number", "issue_date", "currency", "vendor", "customer", "line_items", "total"],
    "additionalProperties": False,
}


def _strip(schema, keys):
    if isinstance(schema, dict):
        return {k: _strip(v, keys) for k, v in schema.items() if k not in keys}
    if isinstance(schema, list):
        return [_strip(v, keys) for v in schema]
    return schema


GRAMMARS = {
    "invoice": INVOICE,
    "invoice-lite": _strip(INVOICE, {"maxLength", "maxItems"}),  # what outlines-core can compile
    "json_object": None,  # any JSON object ({"type": "object"}, response_format json_object)
}

# (feature, schema, valid instances, invalid instances). Instances are written compactly.
COVERAGE = [
    ("enum", {"enum": ["red", "green", 1]}, ["red", 1], ["blue", 2]),
    ("const", {"const": "fixed"}, ["fixed"], ["other"]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}, [5, "abc"], [True, "abcdef"]),
    ("oneOf (disjoint)", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [5, True], ["x"]),
    ("oneOf (exclusive: int matches both)", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, [1.5], [5]),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    ("$ref/$defs", {"$defs": {"item": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/item"}},
     [[1, 2], []], [["x"]]),
    ("$ref recursive", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     [{"v": 1, "children": [{"v": 2, "children": [{"v": 3, "children": [{"v": 4, "children": [{"v": 5}]}]}]}]}],
     [{"v": 1, "children": [{"w": 2}]}]),
    ("pattern", {"type": "string", "pattern": "^INV-[0-9]{4}$"}, ["INV-2024"], ["INV-20", "XINV-2024"]),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd"], ["a", "abcde"]),
    ("format: date", {"type": "string", "format": "date"}, ["2024-01-31"],
     ["31/01/2024", "2024-13-01", "\u0968\u0966\u0968\u096a-01-31"]),  # the last: Devanagari digits
    ("pattern with \\d (ASCII digits in JSON Schema)", {"type": "string", "pattern": "^[A-Z]+-\\d{4}$"}, ["INV-2024"],
     ["INV-\uff12\uff10\uff12\uff14"]),  # fullwidth digits
    ("format: date-time", {"type": "string", "format": "date-time"}, ["2024-01-31T12:00:00Z"],
     ["2024-01-31 12:00", "yesterday"]),
    ("format: email", {"type": "string", "format": "email"}, ["a.b@example.com"], ["not-an-email"]),
    ("format: uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     ["1234", "123e4567e89b12d3a456426614174000"]),
    ("minimum/maximum (integer)", {"type": "integer", "minimum": 1, "maximum": 10}, [1, 10], [0, 11, -3]),
    ("minimum/maximum (number)", {"type": "number", "minimum": 0.5, "maximum": 2.5}, [1.5, 0.5], [3, 0.25, -1]),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}, [1], [0]),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     [[1], [1, 2]], [[], [1, 2, 3]]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2]], [[1, 1]]),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, [{"a": 1}, {}], [{"a": 1, "b": 2}]),
    ("additionalProperties: true", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": True}, [{"a": 1, "b": 2}], [{"a": "x"}]),
    ("additionalProperties: schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "additionalProperties": {"type": "string"}},
     [{"a": 1, "b": "x"}], [{"a": 1, "b": 2}]),
    ("additionalProperties unspecified", {"type": "object", "properties": {"a": {"type": "integer"}}},
     [{"a": 1, "b": 2}], [{"a": "x"}]),
    ("required subset", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                        "c": {"type": "integer"}},
                         "required": ["b"], "additionalProperties": False},
     [{"b": 1}, {"a": 1, "b": 2}, {"b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}], [{"a": 1}, {"a": 1, "c": 3}, {}]),
    ("property order free (schema order b,a given as a,b)", {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}, [{"a": 1, "b": 2}], []),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, [{"x_a": 1}], [{"y": 1}, {"x_a": "s"}]),
    ("type list [string, null]", {"type": ["string", "null"]}, ["a", None], [1]),
    ("if/then/else", {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"}},
                      "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]},
                      "else": {"not": {"required": ["x"]}}},
     [{"kind": "a", "x": 1}, {"kind": "b"}], [{"kind": "a"}, {"kind": "b", "x": 1}]),
]

INVALID_SCHEMAS = [
    ("type typo", {"type": "strnig"}),
    ("dangling $ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
    ("minLength not a number", {"type": "string", "minLength": "x"}),
    ("unknown keyword", {"type": "string", "fooBar": 1}),
    ("unsatisfiable (minimum > maximum)", {"type": "integer", "minimum": 5, "maximum": 1}),
]

LARK_PLAIN = """start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
LARK_COMMON = """start: pair ("," pair)*
pair: WORD "=" NUMBER
%import common.WORD
%import common.NUMBER
%import common.WS
%ignore WS
"""
LARK_BAD = "start: undefined_rule\n"
GBNF = 'root ::= "yes" | "no" | [0-9]+\n'
REGEX = r"[A-Z]{2,4}-\d{4}"
REGEX_LOOKAHEAD = r"(?=a)ab"

SYNTAX = [
    # (name, kind, source, valid strings, invalid strings)
    ("lark (rules, regex terminals)", "lark", LARK_PLAIN, ["1+(2-3)", "42"], ["1++2", "(1"]),
    ("lark %import common + %ignore", "lark", LARK_COMMON, ["a=1, b=2", "x=3"], ["a=, b"]),
    ("lark: undefined rule", "lark", LARK_BAD, [], []),
    ("GBNF (llama.cpp)", "gbnf", GBNF, ["yes", "42"], ["maybe"]),
    ("regex", "regex", REGEX, ["INV-2024", "AB-0001"], ["inv-2024", "INV-20"]),
    ("regex with lookahead", "regex", REGEX_LOOKAHEAD, ["ab"], ["b"]),
    ("regex, optional part after an accepting state", "regex", r"[0-9]+(\.[0-9]+)?", ["15", "1.5"], ["1.", ".5"]),
    ("JSON schema: top-level number", "json_schema", {"type": "number"}, ["15", "1.5", "-2e3"], ["1.", "abc"]),
    ("JSON string: escapes vs raw control chars", "json_schema", {"type": "string"},
     ['"a\\tb"', '"\\u00e9"'], ['"a\tb"', '"a\x01b"']),
    ("JSON string with maxLength: escapes vs raw control chars", "json_schema", {"type": "string", "maxLength": 64},
     ['"a\\tb"', '"\\u00e9"'], ['"a\tb"', '"a\x01b"']),
]


def wrap(schema: dict) -> dict:
    """{"v": <schema>} as a closed object (with $defs kept at the root): coverage is checked
    inside an object so that an engine's handling of a top-level scalar does not decide it."""
    inner = dict(schema)
    defs = inner.pop("$defs", None)
    out = {"type": "object", "properties": {"v": inner}, "required": ["v"], "additionalProperties": False}
    if defs is not None:
        out["$defs"] = defs
    return out


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------------------
# Engine adapters (run inside a worker subprocess)
# ---------------------------------------------------------------------------------------


class Unsupported(Exception):
    pass


def _now() -> int:
    return time.perf_counter_ns()


class Base:
    name = ""
    native_apply_name = ""

    def __init__(self, model_dir: str, vocab_size: int, layout: str):
        self.model_dir, self.V, self.layout = model_dir, vocab_size, layout
        self.words = (vocab_size + 31) // 32

    def modules_loaded(self) -> dict:
        return {m: m in sys.modules for m in ("torch", "transformers", "triton", "numpy")}


class LLG(Base):
    name = "llguidance"
    native_apply_name = "llguidance.torch (torch.compile)"

    def import_(self):
        import llguidance  # noqa: F401

        self.llg = llguidance

    def version(self) -> str:
        return self.llg.get_version()

    def build_tokenizer(self):
        """From tokenizer.json directly (no transformers)."""
        self.tok = self.llg.LLTokenizer(os.path.join(self.model_dir, "tokenizer.json"), n_vocab=self.V,
                                        eos_token=list(EOS_IDS))

    def build_tokenizer_hf(self):
        import llguidance.hf
        from transformers import AutoTokenizer

        t0 = _now()
        hf = AutoTokenizer.from_pretrained(self.model_dir)
        t1 = _now()
        llguidance.hf.from_tokenizer(hf, n_vocab=self.V, eos_token=list(EOS_IDS))
        return (t1 - t0) / 1e6, (_now() - t1) / 1e6

    def _layout(self):
        if self.layout == "flexible":
            return {}
        if self.layout == "compact":
            return {"whitespace_flexible": False, "key_separator": ":", "item_separator": ","}
        return {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

    def compile(self, kind, source, defaults=True):
        llg = self.llg
        if kind == "json_schema":
            schema = {"type": "object"} if source is None else source
            if defaults:
                grammar = llg.LLMatcher.grammar_from_json_schema(schema)
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=self._layout())
        elif kind in ("lark", "gbnf", "regex"):
            grammar = llg.grammar_from(kind, source)
        else:
            raise Unsupported(kind)
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        self.warnings = m.get_grammar_warnings()
        return (grammar, m)

    def matcher(self, compiled):
        return compiled[1].deep_copy()

    def matcher_fresh(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled[0], log_level=0)

    def fill(self, m, bm):
        m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)
        return True

    def native_apply(self, logits, bm):
        import llguidance.torch

        llguidance.torch.apply_token_bitmask_inplace(logits, bm)

    def advance(self, m, tok) -> bool:
        return m.consume_token(tok)

    def finished(self, m) -> bool:
        return m.is_stopped()

    def clone(self, m):
        return m.deep_copy()

    def rollback(self, m, n):
        if not m.rollback(n):
            raise RuntimeError("rollback refused: " + m.get_error())

    def reset(self, m):
        m.reset()

    def accepts(self, compiled, text: str) -> bool:
        m = self.matcher(compiled)
        toks = self.tok.tokenize_str(text)
        if not m.consume_tokens(toks):
            return False
        return m.is_accepting()

    def gil_note(self):
        return "compute_mask/unsafe_compute_mask_ptr documented to drop the GIL"


class XGR(Base):
    name = "xgrammar"
    native_apply_name = "xgrammar CPU kernel (C++)"

    def import_(self):
        import xgrammar  # noqa: F401  (imports torch and transformers at module level)

        self.xgr = xgrammar

    def version(self) -> str:
        from importlib.metadata import version

        return f"xgrammar {version('xgrammar')}, apache-tvm-ffi {version('apache-tvm-ffi')}"

    def build_tokenizer(self):
        """From tokenizer.json through tokenizers.Tokenizer (xgrammar itself imports transformers)."""
        import tokenizers

        ht = tokenizers.Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
        vocab = ht.get_vocab(with_added_tokens=True)
        encoded = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            encoded[i] = token
        self.info = self.xgr.TokenizerInfo(encoded, self.xgr.VocabType.BYTE_LEVEL, vocab_size=self.V,
                                           stop_token_ids=list(EOS_IDS), add_prefix_space=False)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=2)

    def build_tokenizer_hf(self):
        from transformers import AutoTokenizer

        t0 = _now()
        hf = AutoTokenizer.from_pretrained(self.model_dir)
        t1 = _now()
        self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.V, stop_token_ids=list(EOS_IDS))
        return (t1 - t0) / 1e6, (_now() - t1) / 1e6

    def _layout(self):
        if self.layout == "flexible":
            return {"any_whitespace": True}
        if self.layout == "compact":
            return {"any_whitespace": False, "separators": (",", ":")}
        return {"any_whitespace": False, "separators": (", ", ": ")}

    def compile(self, kind, source, defaults=True, compiler=None):
        compiler = compiler or self.compiler
        kw = {} if defaults else self._layout()
        self.warnings = []
        if kind == "json_schema":
            if source is None:  # any JSON object: strict_mode would close it to {}
                return compiler.compile_json_schema({"type": "object"}, strict_mode=False, **kw)
            return compiler.compile_json_schema(source, **kw)
        if kind == "lark":
            return compiler.compile_lark(source)
        if kind == "gbnf":
            return compiler.compile_grammar(self.xgr.Grammar.from_ebnf(source))
        if kind == "regex":
            return compiler.compile_regex(source)
        raise Unsupported(kind)

    def recompile_uncached(self, kind, source):
        self.compiler.clear_cache()
        return self.compile(kind, source, defaults=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    matcher_fresh = matcher

    def fill(self, m, bm):
        return m.fill_next_token_bitmask(bm)

    def native_apply(self, logits, bm):
        self.xgr.apply_token_bitmask_inplace(logits, bm)

    def advance(self, m, tok) -> bool:
        return m.accept_token(tok)

    def finished(self, m) -> bool:
        return m.is_terminated()

    def clone(self, m):
        return m.fork()

    def rollback(self, m, n):
        m.rollback(n)

    def reset(self, m):
        m.reset()

    def accepts(self, compiled, text: str) -> bool:
        m = self.matcher(compiled)
        return bool(m.accept_string(text)) and m.is_completed()


class OC(Base):
    name = "outlines-core"
    native_apply_name = "outlines_core.kernels.torch (torch.compile)"

    def import_(self):
        import outlines_core  # noqa: F401

        self.oc = outlines_core

    def version(self) -> str:
        from importlib.metadata import version

        return f"outlines-core {version('outlines-core')}"

    def build_tokenizer(self):
        """Vocabulary(eos, {token bytes: [ids]}) from tokenizer.json (byte-level BPE decoded with
        GPT-2's byte table). One EOS only; special added tokens left out (they are not text)."""
        import tokenizers

        from qvl.processing.tokenizer import bytes_to_unicode

        self.ht = tokenizers.Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
        data = json.loads(self.ht.to_str())
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        mapping: dict[bytes, list[int]] = {}
        for token, i in data["model"]["vocab"].items():
            mapping.setdefault(bytes(u2b[c] for c in token), []).append(i)
        for added in data.get("added_tokens", []):
            if not added.get("special") and added["id"] not in EOS_IDS:
                mapping.setdefault(added["content"].encode(), []).append(added["id"])
        self.vocab = self.oc.Vocabulary(EOS_IDS[0], mapping)

    def build_tokenizer_hf(self):
        raise Unsupported("Vocabulary.from_pretrained downloads tokenizer.json from the Hub (no local path)")

    def _ws(self, defaults):
        if defaults or self.layout == "flexible":
            return None  # outlines' default: [ ]? between tokens
        if self.layout == "compact":
            return ""
        return "[ ]?"  # cannot say ", " / ": " exactly: an optional space

    def compile(self, kind, source, defaults=True):
        self.warnings = []
        if kind == "json_schema":
            schema = {"type": "object"} if source is None else source
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), self._ws(defaults))
        elif kind == "regex":
            regex = source
        else:
            raise Unsupported(f"{kind}: outlines-core takes regular expressions (and JSON schemas) only")
        self.regex_len = len(regex)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    matcher_fresh = matcher

    def fill(self, m, bm):
        m.write_mask_into(bm.data_ptr(), bm.numel(), 4)
        return True

    def native_apply(self, logits, bm):
        from outlines_core.kernels.torch import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, bm)

    def advance(self, m, tok) -> bool:
        try:
            m.advance(tok, return_tokens=False)
            return True
        except ValueError:
            return False

    def finished(self, m) -> bool:
        return m.is_finished()

    def clone(self, m):
        return copy.copy(m)

    def rollback(self, m, n):
        m.rollback_state(n)

    def reset(self, m):
        m.reset()

    def accepts(self, compiled, text: str) -> bool:
        m = self.matcher(compiled)
        for tok in self.ht.encode(text, add_special_tokens=False).ids:
            if not self.advance(m, tok):
                return False
        return compiled.is_final_state(m.get_state())  # is_finished() also wants no continuation


ADAPTERS = {"llguidance": LLG, "xgrammar": XGR, "outlines-core": OC}


# ---------------------------------------------------------------------------------------
# Engine-free mask application (for reference)
# ---------------------------------------------------------------------------------------


def make_eager_apply(V: int):
    import torch

    shifts = torch.arange(32, dtype=torch.int32)

    def apply(logits, bm):
        bits = torch.bitwise_right_shift(bm.unsqueeze(-1), shifts) & 1  # [1, W, 32]
        allowed = bits.view(bm.shape[0], -1)[:, :V].bool()
        logits.masked_fill_(~allowed, float("-inf"))

    return apply


def make_numpy_apply(V: int):
    import numpy as np
    import torch

    def apply(logits, bm):
        allowed = np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:V]
        logits.masked_fill_(torch.from_numpy(allowed).view(1, -1) == 0, float("-inf"))

    return apply


def stats_us(ns_list):
    import numpy as np

    if not ns_list:
        return None
    a = np.asarray(ns_list, dtype=np.float64) / 1e3
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "max": float(a.max()),
            "mean": float(a.mean()), "n": int(a.size)}


# ---------------------------------------------------------------------------------------
# Worker: one engine, one grammar (perf) or the engine's coverage
# ---------------------------------------------------------------------------------------


def worker_setup(args, res):
    t0 = _now()
    eng = ADAPTERS[args.engine](args.model, args.vocab_size, args.layout)
    eng.import_()
    res["import_ms"] = (_now() - t0) / 1e6
    res["modules_after_import"] = eng.modules_loaded()
    res["version"] = eng.version()
    t0 = _now()
    eng.build_tokenizer()
    res["tokenizer_ms"] = (_now() - t0) / 1e6
    res["modules_after_tokenizer"] = eng.modules_loaded()
    return eng


def walk(eng, compiled, max_tokens, seed, appliers, eager_check):
    import torch

    m = eng.matcher(compiled)
    gen = torch.Generator().manual_seed(seed)
    bm = torch.full((1, eng.words), -1, dtype=torch.int32)
    rec = {"mask": [], "advance": [], **{name: [] for name in appliers}}
    tokens, completed, skipped_apply, mismatches = [], False, 0, 0
    for _ in range(max_tokens):
        base = torch.randn(1, eng.V, generator=gen)
        t0 = _now()
        need = eng.fill(m, bm)
        rec["mask"].append(_now() - t0)
        if need is False:
            skipped_apply += 1
        outs = {}
        for name, fn in appliers.items():
            lg = base.clone()
            t0 = _now()
            fn(lg, bm)
            rec[name].append(_now() - t0)
            outs[name] = lg
        first = next(iter(outs.values()))
        if eager_check:
            ref = torch.isinf(first)
            for name, lg in outs.items():
                if not torch.equal(torch.isinf(lg), ref):
                    mismatches += 1
        tok = int(first.argmax())
        if first[0, tok] == float("-inf"):
            raise RuntimeError(f"empty mask after {len(tokens)} tokens")
        if not (int(bm[0, tok // 32]) >> (tok % 32)) & 1:
            raise RuntimeError(f"token {tok} chosen but not in the mask")
        t0 = _now()
        ok = eng.advance(m, tok)
        rec["advance"].append(_now() - t0)
        if not ok:
            raise RuntimeError(f"matcher refused its own masked token {tok} after {len(tokens)} tokens")
        tokens.append(tok)
        if tok in EOS_IDS:
            completed = True
            break
    return rec, tokens, completed, skipped_apply, mismatches, m


def decode(model_dir, ids):
    import tokenizers

    ht = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return ht.decode([i for i in ids if i not in EOS_IDS], skip_special_tokens=False)


def validate_output(text, schema):
    try:
        value = json.loads(text)
    except Exception as exc:
        return f"not JSON: {exc}"
    try:
        import jsonschema

        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        return "valid"
    except ImportError:
        return "parsed (jsonschema not installed)"
    except Exception as exc:
        return f"INVALID: {str(exc).splitlines()[0][:160]}"


def worker_perf(args, res):
    eng = worker_setup(args, res)  # first, so that it sees what the engine itself imports
    import torch

    torch.set_num_threads(args.threads)
    schema = GRAMMARS[args.grammar]
    bm = torch.full((1, eng.words), -1, dtype=torch.int32)
    for attempt in ("cold", "again"):
        t0 = _now()
        compiled = eng.compile("json_schema", schema, defaults=False)
        t1 = _now()
        m = eng.matcher(compiled)
        t2 = _now()
        eng.fill(m, bm)
        t3 = _now()
        res[f"compile_{attempt}"] = {"compile_ms": (t1 - t0) / 1e6, "matcher_ms": (t2 - t1) / 1e6,
                                     "first_mask_ms": (t3 - t2) / 1e6,
                                     "allowed_first": int(_popcount(bm, eng.V))}
    if isinstance(eng, XGR):
        t0 = _now()
        eng.recompile_uncached("json_schema", schema)
        res["compile_uncached_ms"] = (_now() - t0) / 1e6
    if isinstance(eng, OC):
        res["regex_chars"] = eng.regex_len

    # mask application: warm the compiled kernels up first (torch.compile on first call)
    appliers = {}
    warm = {}
    try:
        lg = torch.randn(1, eng.V)
        t0 = _now()
        eng.native_apply(lg, bm)
        warm["native_first_call_ms"] = (_now() - t0) / 1e6
        t0 = _now()
        eng.native_apply(torch.randn(1, eng.V), bm)
        warm["native_second_call_ms"] = (_now() - t0) / 1e6
        appliers["apply_native"] = eng.native_apply
    except Exception as exc:
        warm["native_error"] = repr(exc)[:300]
    appliers["apply_eager"] = make_eager_apply(eng.V)
    appliers["apply_numpy"] = make_numpy_apply(eng.V)
    res["apply_warmup"] = warm
    res["apply_native_name"] = eng.native_apply_name

    walks = []
    all_rec = {}
    first_tokens = None
    for w in range(args.walks):
        rec, tokens, completed, skipped, mism, _m = walk(eng, compiled, args.tokens, args.seed + w, appliers,
                                                         eager_check=True)
        text = decode(args.model, tokens)
        info = {"tokens": len(tokens), "completed": completed, "need_apply_false": skipped,
                "apply_mismatches": mism, "text_head": text[:160]}
        if completed and schema is not None:
            info["output"] = validate_output(text, schema)
        walks.append(info)
        for k, v in rec.items():
            all_rec.setdefault(k, []).extend(v)
        if first_tokens is None or (completed and len(tokens) > len(first_tokens)):
            first_tokens = tokens
    res["walks"] = walks
    res["per_token_us"] = {k: stats_us(v) for k, v in all_rec.items()}
    # state and thread tests on the invoice (outlines-core cannot compile it: on invoice-lite)
    if args.state and (args.grammar == "invoice" or (args.grammar == "invoice-lite" and isinstance(eng, OC))):
        state_tests(eng, compiled, first_tokens, res)
        thread_tests(eng, compiled, first_tokens, res, args)
    # last, so that it cannot warm anything up for the cold numbers above
    try:
        a, b = eng.build_tokenizer_hf()
        res["tokenizer_hf_ms"] = {"AutoTokenizer": a, "engine": b}
    except Unsupported as exc:
        res["tokenizer_hf_ms"] = f"n/a: {exc}"
    except Exception as exc:
        res["tokenizer_hf_ms"] = f"failed: {exc!r}"[:300]


def _popcount(bm, V):
    import numpy as np

    return int(np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:V].sum())


def state_tests(eng, compiled, tokens, res):
    import statistics

    import torch

    out = {}
    toks = [t for t in tokens if t not in EOS_IDS]
    k = max(1, min(60, len(toks) - 12))
    m = eng.matcher(compiled)
    bm = torch.full((1, eng.words), -1, dtype=torch.int32)
    for t in toks[:k]:
        eng.fill(m, bm)
        eng.advance(m, t)
    out["at_token"] = k
    try:
        times, clones = [], []
        for _ in range(20):
            t0 = _now()
            c = eng.clone(m)
            times.append(_now() - t0)
            clones.append(c)
        out["clone_us"] = statistics.median(times) / 1e3
        a = torch.empty_like(bm)
        b = torch.empty_like(bm)
        eng.fill(m, a)
        eng.fill(clones[0], b)
        same = torch.equal(a, b)
        eng.advance(clones[0], toks[k])  # the clone moves on, the original must not
        eng.fill(m, b)
        out["clone_independent_and_equal"] = bool(same and torch.equal(a, b))
    except Exception as exc:
        out["clone_error"] = repr(exc)[:300]
    try:
        before = torch.empty_like(bm)
        eng.fill(m, before)
        for t in toks[k:k + 10]:
            eng.fill(m, bm)
            eng.advance(m, t)
        t0 = _now()
        eng.rollback(m, 10)
        out["rollback10_us"] = (_now() - t0) / 1e3
        after = torch.empty_like(bm)
        eng.fill(m, after)
        out["rollback_restores_mask"] = bool(torch.equal(before, after))
    except Exception as exc:
        out["rollback_error"] = repr(exc)[:300]
    times = []
    for _ in range(10):
        t0 = _now()
        eng.matcher(compiled)
        times.append(_now() - t0)
    out["new_matcher_us"] = statistics.median(times) / 1e3
    if eng.matcher_fresh != eng.matcher:
        times = []
        for _ in range(10):
            t0 = _now()
            eng.matcher_fresh(compiled)
            times.append(_now() - t0)
        out["new_matcher_from_grammar_us"] = statistics.median(times) / 1e3
    res["state"] = out


def gil_probe(eng, compiled, toks, calls=40):
    """Does a mask fill / an advance release the GIL? A spinner thread counts in pure Python;
    with a 50 ms switch interval it can only run while the measuring thread is inside a call
    that released the GIL (then the measuring thread has to wait for it, so the counter has
    moved when the call returns). Holding the GIL for the whole call leaves the counter still."""
    import torch

    counter, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    out = {}
    try:
        m = eng.matcher(compiled)
        bm = torch.full((1, eng.words), -1, dtype=torch.int32)
        moved = {"mask": 0, "advance": 0}
        durations = {"mask": [], "advance": []}
        n = 0
        for t in toks[:calls]:
            c0 = counter[0]
            t0 = _now()
            eng.fill(m, bm)
            t1 = _now()
            c1 = counter[0]
            t2 = _now()
            eng.advance(m, t)
            t3 = _now()
            c2 = counter[0]
            moved["mask"] += c1 > c0
            moved["advance"] += c2 > c1
            durations["mask"].append(t1 - t0)
            durations["advance"].append(t3 - t2)
            n += 1
        for k in moved:
            ds = sorted(durations[k])
            out[k] = {"calls": n, "moved": moved[k], "median_call_us": ds[len(ds) // 2] / 1e3}
    finally:
        stop.set()
        sys.setswitchinterval(old_interval)
        spinner.join()
    return out


def thread_tests(eng, compiled, tokens, res, args):
    """GIL: gil_probe. Throughput: steps/s (mask + advance per token, replaying the walk) of
    one thread and of two threads at once, each with its own matcher. Overlap: the replay in a
    background thread against a torch GEMV loop in the main thread (torch with --threads and
    with 1 thread)."""
    import torch

    toks = list(tokens)
    out = {}

    def scaling(target, seconds=1.0):
        """steps/s of one thread, of two threads together (each its own matcher)."""
        rates = []
        for n in (1, 2):
            stop, counters = threading.Event(), [[0] for _ in range(n)]
            ths = [threading.Thread(target=target, args=(stop, c)) for c in counters]
            t0 = time.perf_counter()
            for th in ths:
                th.start()
            time.sleep(seconds)
            stop.set()
            for th in ths:
                th.join()
            rates.append(sum(c[0] for c in counters) / (time.perf_counter() - t0))
        return {"one_thread_per_s": rates[0], "two_threads_per_s": rates[1], "scaling": rates[1] / rates[0]}

    def replayer(make):
        def replay(stop, counter):
            m = make(compiled)
            bm = torch.full((1, eng.words), -1, dtype=torch.int32)
            while not stop.is_set():
                for t in toks:
                    eng.fill(m, bm)
                    eng.advance(m, t)
                    counter[0] += 1
                    if stop.is_set():
                        break
                m = make(compiled)

        return replay

    replay = replayer(eng.matcher)

    out["gil"] = gil_probe(eng, compiled, toks)
    out["scaling_replay"] = scaling(replay)
    if eng.matcher_fresh != eng.matcher:  # llguidance: matchers built from the grammar, not deep copies
        out["scaling_replay_fresh"] = scaling(replayer(eng.matcher_fresh))
    out["replay_alone_steps_per_s"] = out["scaling_replay"]["one_thread_per_s"]

    # a decode step is mostly GEMVs: [1, 2048] @ [2048, 6144] float32
    w = torch.randn(6144, 2048)
    x = torch.randn(1, 2048)

    def gemv_loop(n=200):
        t = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.linear(x, w)
        return (time.perf_counter() - t) / n * 1e3

    for nthreads in sorted({args.threads, 1}, reverse=True):
        torch.set_num_threads(nthreads)
        gemv_loop(20)
        alone = gemv_loop()
        stop, counter = threading.Event(), [0]
        th = threading.Thread(target=replay, args=(stop, counter))
        th.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        c0 = counter[0]
        together = gemv_loop()
        elapsed = time.perf_counter() - t0
        c1 = counter[0]
        stop.set()
        th.join()
        out[f"gemv_t{nthreads}"] = {"alone_ms": alone, "with_replay_ms": together,
                                    "replay_steps_per_s": (c1 - c0) / max(elapsed, 1e-9)}
    torch.set_num_threads(args.threads)
    res["threads"] = out


CASE_MARK = "@@CASE@@"


def _case_start(name):
    print(CASE_MARK + name, flush=True)


def worker_coverage(args, res):
    eng = worker_setup(args, res)
    skip = set(json.loads(args.skip_cases or "[]"))
    cov = []
    for feature, schema, valid, invalid in COVERAGE:
        row = {"feature": feature}
        if feature in skip:
            cov.append({**row, "error": "CRASHED the worker: " + skip_reason(args, feature)})
            continue
        _case_start(feature)
        t0 = _now()
        try:
            compiled = eng.compile("json_schema", wrap(schema), defaults=True)
            row["compile_ms"] = (_now() - t0) / 1e6
            row["warnings"] = [str(w)[:200] for w in getattr(eng, "warnings", [])]
            row["valid"] = [[compact(v), _safe_accepts(eng, compiled, compact({"v": v}))] for v in valid]
            row["invalid"] = [[compact(v), _safe_accepts(eng, compiled, compact({"v": v}))] for v in invalid]
        except Exception as exc:
            row["compile_ms"] = (_now() - t0) / 1e6
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        cov.append(row)
        print(f"[{eng.name}] {feature}: done", file=sys.stderr, flush=True)
    res["coverage"] = cov
    bad = []
    for name, schema in INVALID_SCHEMAS:
        row = {"case": name, "schema": compact(schema)}
        if name in skip:
            bad.append({**row, "result": "CRASHED the worker: " + skip_reason(args, name)})
            continue
        _case_start(name)
        try:
            compiled = eng.compile("json_schema", schema, defaults=True)
            row["result"] = "compiled without error"
            if getattr(eng, "warnings", None):
                row["warnings"] = [str(w)[:200] for w in eng.warnings]
        except Exception as exc:
            row["result"] = f"raised {type(exc).__name__}: {exc}"[:400]
        bad.append(row)
    res["invalid_schemas"] = bad
    syn = []
    for name, kind, source, valid, invalid in SYNTAX:
        row = {"case": name, "kind": kind}
        if name in skip:
            syn.append({**row, "error": "CRASHED the worker: " + skip_reason(args, name)})
            continue
        _case_start(name)
        t0 = _now()
        try:
            compiled = eng.compile(kind, source, defaults=True)
            row["compile_ms"] = (_now() - t0) / 1e6
            row["valid"] = [[v, _safe_accepts(eng, compiled, v)] for v in valid]
            row["invalid"] = [[v, _safe_accepts(eng, compiled, v)] for v in invalid]
        except Unsupported as exc:
            row["error"] = f"unsupported: {exc}"
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        syn.append(row)
    res["syntax"] = syn


def worker_apply(args, res):
    """Mask application alone: each kernel on synthetic masks, logits [1, V] float32 cloned
    fresh for each call (median of 300 calls, after a first call that is timed apart)."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    V, W = args.vocab_size, (args.vocab_size + 31) // 32
    kernels = {"eager torch (shift + masked_fill_)": make_eager_apply(V),
               "numpy.unpackbits + masked_fill_": make_numpy_apply(V)}
    errors = {}
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        try:
            eng = ADAPTERS[name](args.model, V, args.layout)
            eng.import_()
            kernels[eng.native_apply_name] = eng.native_apply
        except Exception as exc:
            errors[name] = repr(exc)[:200]
    rng = np.random.default_rng(0)
    few = torch.zeros((1, W), dtype=torch.int32)
    few[0, :10] = 1
    masks = {"all allowed": torch.full((1, W), -1, dtype=torch.int32),
             "10 allowed": few,
             "random half": torch.from_numpy(rng.integers(-(2 ** 31), 2 ** 31 - 1, size=(1, W), dtype=np.int32))}
    base = torch.randn(1, V)
    ref = {}
    for mname, bm in masks.items():
        lg = base.clone()
        kernels["eager torch (shift + masked_fill_)"](lg, bm)
        ref[mname] = torch.isinf(lg)
    out = {}
    for kname, fn in kernels.items():
        row = {}
        try:
            lg = base.clone()
            t0 = _now()
            fn(lg, masks["all allowed"])
            row["first_call_ms"] = (_now() - t0) / 1e6
            for mname, bm in masks.items():
                times = []
                for _ in range(300):
                    lg = base.clone()
                    t0 = _now()
                    fn(lg, bm)
                    times.append(_now() - t0)
                row[mname] = float(np.median(times)) / 1e3
                row[mname + " correct"] = bool(torch.equal(torch.isinf(lg), ref[mname]))
        except Exception as exc:
            row["error"] = repr(exc)[:200]
        out[kname] = row
    res["apply"] = out
    res["apply_errors"] = errors


def skip_reason(args, name):
    return json.loads(args.skip_reasons or "{}").get(name, "")


def _safe_accepts(eng, compiled, text):
    try:
        return bool(eng.accepts(compiled, text))
    except Exception as exc:
        return f"error: {exc!r}"[:200]


def worker_main(args):
    if args.mem_limit_gb:
        lim = int(args.mem_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    res = {"engine": args.engine, "grammar": args.grammar, "task": args.task}
    try:
        if args.task == "perf":
            worker_perf(args, res)
        elif args.task == "apply":
            worker_apply(args, res)
        else:
            worker_coverage(args, res)
        res["ok"] = True
    except Exception as exc:
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"[:600]
        res["traceback"] = traceback.format_exc()[-2000:]
    res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(MARK + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------
# Parent: run workers, print tables
# ---------------------------------------------------------------------------------------


def cpu_busy(seconds=0.5) -> float:
    """Share of the machine's CPU time not idle over `seconds` (from /proc/stat; -1 if unknown)."""
    def snap():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]

    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
        return 1.0 - (i1 - i0) / max(t1 - t0, 1)
    except OSError:
        return -1.0


def _proc_stat():
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    t = os.times()
    return sum(vals), sum(vals) - vals[3] - vals[4], t.children_user + t.children_system


def others_cpu(before, after) -> float:
    """Share of all CPUs' time used by processes other than the worker between two _proc_stat()."""
    total, busy, child = (a - b for a, b in zip(after, before))
    return max(0.0, (busy - child * os.sysconf("SC_CLK_TCK")) / max(total, 1))


def wait_idle(args):
    """Before a timed worker: wait (up to --wait-idle s) for other processes to leave the CPUs."""
    busy = cpu_busy()
    deadline = time.time() + args.wait_idle
    while busy > args.idle_threshold and time.time() < deadline:
        time.sleep(2)
        busy = cpu_busy()
    return busy


def run_worker(args, engine, task, grammar=None, skip=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--engine", engine, "--task", task,
           "--engines", args.engines,
           "--model", args.model, "--tokens", str(args.tokens), "--walks", str(args.walks), "--seed", str(args.seed),
           "--threads", str(args.threads), "--layout", args.layout, "--vocab-size", str(args.vocab_size),
           "--mem-limit-gb", str(args.mem_limit_gb)]
    if grammar:
        cmd += ["--grammar", grammar]
    if skip:
        cmd += ["--skip-cases", json.dumps(list(skip)), "--skip-reasons", json.dumps(skip)]
    if not args.state:
        cmd += ["--no-state"]
    busy_before = wait_idle(args) if task in ("perf", "apply") else None
    t0 = time.perf_counter()
    stat0 = _proc_stat()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "grammar": grammar, "task": task, "ok": False,
                "error": f"timed out after {args.timeout} s", "wall_s": time.perf_counter() - t0}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["wall_s"] = time.perf_counter() - t0
            res["cpu_busy_before"] = busy_before
            res["others_cpu_during"] = others_cpu(stat0, _proc_stat())
            return res
    tail = (p.stderr or "")[-600:].strip().replace("\n", " | ")
    sig = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
    cases = [line[len(CASE_MARK):] for line in p.stdout.splitlines() if line.startswith(CASE_MARK)]
    return {"engine": engine, "grammar": grammar, "task": task, "ok": False,
            "error": f"worker died ({sig}); stderr tail: {tail}", "wall_s": time.perf_counter() - t0,
            "last_case": cases[-1] if cases else None}


def run_coverage(args, engine):
    """The coverage worker again without each case that killed it (out of memory, say)."""
    skip = {}
    while True:
        r = run_worker(args, engine, "coverage", skip=skip)
        if r.get("ok") or not r.get("last_case") or r["last_case"] in skip:
            return r
        short = r["error"].split("; stderr tail:")[0]
        tail = r["error"].split("stderr tail:")[-1].strip().split(" | ")[-1][-120:]
        skip[r["last_case"]] = f"{short}, after {r['wall_s']:.0f} s: {tail}"
        print(f"    {r['last_case']}: {skip[r['last_case']]}; again without it", file=sys.stderr, flush=True)


def fmt(x, digits=1):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:,.{digits}f}"
    return str(x)


def oneline(text) -> str:
    return " ".join(str(text).split())


def table(headers, rows):
    rows = [[oneline(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = [line, sep]
    for r in rows:
        out.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(out)


def verdict(row):
    if "error" in row:
        if row["error"].startswith("CRASHED"):
            return row["error"][:220]
        return "REJECTS schema: " + row["error"][:150]
    valid_ok = all(a is True for _, a in row["valid"])
    inv = [a for _, a in row["invalid"]]
    errs = [a for _, a in row["valid"] + row["invalid"] if isinstance(a, str)]
    if errs:
        return "check error: " + errs[0]
    rejected = sum(1 for a in inv if a is False)
    if not inv:
        return "accepted" if valid_ok else "valid REJECTED: " + ", ".join(v for v, a in row["valid"] if a is not True)
    if valid_ok and rejected == len(inv):
        v = "enforced"
    elif valid_ok and rejected == 0:
        v = "IGNORED (accepts " + ", ".join(v for v, a in row["invalid"]) + ")"
    elif valid_ok:
        v = "partial (accepts " + ", ".join(v for v, a in row["invalid"] if a is True) + ")"
    else:
        v = ("over-restrictive: rejects valid " + ", ".join(v for v, a in row["valid"] if a is not True)
             + (f"; rejects {rejected}/{len(inv)} invalid" if inv else ""))
    if row.get("warnings"):
        v += " [warn: " + "; ".join(row["warnings"])[:120] + "]"
    return v


def report(results, args):
    perf = [r for r in results if r.get("task") == "perf"]
    cov = {r["engine"]: r for r in results if r.get("task") == "coverage"}
    lines = []
    p = lines.append
    p(f"# grammar engines on {args.model} (V={args.vocab_size}, torch threads={args.threads}, layout={args.layout},"
      f" walks={args.walks} x <= {args.tokens} tokens)\n")

    setup_rows, seen = [], set()
    for r in perf:
        if r["engine"] in seen or "import_ms" not in r:
            continue
        seen.add(r["engine"])
        mods = r.get("modules_after_import", {})
        hf = r.get("tokenizer_hf_ms")
        hf_s = (f"{hf['AutoTokenizer']:.0f} + {hf['engine']:.0f}" if isinstance(hf, dict) else str(hf)[:70])
        setup_rows.append([r["engine"], r.get("version", "")[:40], fmt(r["import_ms"], 0),
                           "torch" if mods.get("torch") else "-", "transformers" if mods.get("transformers") else "-",
                           fmt(r.get("tokenizer_ms"), 0), hf_s])
    p("## setup (ms)\n")
    p(table(["engine", "version", "import", "imports torch?", "imports transformers?",
             "tokenizer info (tokenizer.json)", "via AutoTokenizer (load + engine)"], setup_rows))

    p("\n## compile (ms; each engine+grammar in a fresh process, tokenizer info already built)\n")
    rows = []
    for r in perf:
        if not r.get("ok"):
            rows.append([r["engine"], r["grammar"], "FAILED", "", "", "", r.get("error", "")[:140], "", ""])
            continue
        c1, c2 = r["compile_cold"], r["compile_again"]
        extra = ""
        if "compile_uncached_ms" in r:
            extra = f"cache cleared: {r['compile_uncached_ms']:.1f}"
        if "regex_chars" in r:
            extra = f"regex {r['regex_chars']} chars"
        busy, during = r.get("cpu_busy_before"), r.get("others_cpu_during")
        rows.append([r["engine"], r["grammar"], fmt(c1["compile_ms"] + c1["matcher_ms"], 2), fmt(c1["first_mask_ms"], 2),
                     fmt(c2["compile_ms"] + c2["matcher_ms"], 2), fmt(c2["first_mask_ms"], 2), extra,
                     fmt(r.get("max_rss_mb"), 0),
                     ("-" if busy is None or busy < 0 else f"{busy:.0%}") + " / "
                     + ("-" if during is None else f"{during:.0%}")])
    p(table(["engine", "grammar", "cold compile", "cold 1st mask", "2nd compile", "2nd 1st mask", "note", "max RSS MB",
             "other processes' CPU before / during"], rows))

    p("\n## per token (µs: median / p90 / max)\n")
    rows = []
    for r in perf:
        if not r.get("ok"):
            continue
        s = r["per_token_us"]
        walks = r["walks"]

        def trio(k):
            x = s.get(k)
            return "-" if not x else f"{x['median']:.0f} / {x['p90']:.0f} / {x['max']:.0f}"

        tot = sum((s[k]["median"] if s.get(k) else 0) for k in ("mask", "apply_native", "advance"))
        ntok = "+".join(str(w["tokens"]) for w in walks)
        done = sum(1 for w in walks if w["completed"])
        rows.append([r["engine"], r["grammar"], f"{ntok} ({done}/{len(walks)} done)", trio("mask"), trio("apply_native"),
                     trio("apply_eager"), trio("apply_numpy"), trio("advance"), f"{tot:.0f} ({tot / 500:.2f}%)"])
    p(table(["engine", "grammar", "tokens", "mask fill", "apply (engine's)", "apply eager torch", "apply numpy",
             "advance", "mask+apply+advance median (% of 50 ms)"], rows))
    for r in perf:
        if r.get("ok"):
            w = r.get("apply_warmup", {})
            outs = "; ".join(f"walk{i}: {x.get('output', 'incomplete')}" for i, x in enumerate(r["walks"]))
            p(f"- {r['engine']} / {r['grammar']}: engine apply = {r.get('apply_native_name')}, first call "
              f"{fmt(w.get('native_first_call_ms'))} ms, second {fmt(w.get('native_second_call_ms'), 2)} ms"
              f"{' ERROR ' + w['native_error'] if 'native_error' in w else ''}; outputs: {outs}")

    st = [r for r in perf if r.get("ok") and "state" in r]
    if st:
        p("\n## matcher state (µs)\n")
        rows = []
        for r in st:
            s = r["state"]
            rows.append([f"{r['engine']} ({r['grammar']})", s.get("at_token"), fmt(s.get("clone_us")) if "clone_us" in s else s.get("clone_error", "")[:60],
                         fmt(s.get("clone_independent_and_equal")), fmt(s.get("rollback10_us")) if "rollback10_us" in s else
                         s.get("rollback_error", "")[:60], fmt(s.get("rollback_restores_mask")), fmt(s.get("new_matcher_us")),
                         fmt(s.get("new_matcher_from_grammar_us"))])
        p(table(["engine", "at token", "clone", "clone equal & independent", "rollback 10", "rollback restores mask",
                 "new matcher (copy / from compiled)", "new matcher from grammar text"], rows))

    th = [r for r in perf if r.get("ok") and "threads" in r]
    if th:
        p("\n## threads\n")
        rows = []
        for r in th:
            t = r["threads"]
            row = [f"{r['engine']} ({r['grammar']})"]
            for key in ("mask", "advance"):
                g = t["gil"][key]
                row.append(f"{g['moved']}/{g['calls']} (median call {g['median_call_us']:.0f} µs)")
            g = t["scaling_replay"]
            cell = f"{g['one_thread_per_s']:,.0f} -> {g['two_threads_per_s']:,.0f} (x{g['scaling']:.2f})"
            if "scaling_replay_fresh" in t:
                g = t["scaling_replay_fresh"]
                cell += (f"; matchers built from the grammar, not copies: {g['one_thread_per_s']:,.0f} -> "
                         f"{g['two_threads_per_s']:,.0f} (x{g['scaling']:.2f})")
            row.append(cell)
            for key in sorted(k for k in t if k.startswith("gemv_t")):
                g = t[key]
                row.append(f"{key[6:]} thr: {g['alone_ms']:.2f} -> {g['with_replay_ms']:.2f} "
                           f"({g['replay_steps_per_s']:,.0f} steps/s)")
            rows.append(row)
        ncols = max(len(r) for r in rows)
        p(table(["engine", "mask fill released the GIL (calls)", "advance released the GIL (calls)",
                 "mask+advance steps/s: 1 thread -> 2 threads"]
                + [f"GEMV ms alone -> with replay thread ({i})" for i in range(1, ncols - 3)], rows))
        p("(GIL probe: a Python thread could run during that many of the calls; 0 = the call holds the GIL "
          "throughout, though a call shorter than a thread wake-up (~10-50 µs) can show 0 even when it releases it)")

    ap_rows = [r for r in results if r.get("task") == "apply" and r.get("ok")]
    if ap_rows:
        a = ap_rows[0]
        p("\n## mask application alone (µs, median of 300; logits [1, V] float32)\n")
        rows = []
        for kname, row in a["apply"].items():
            if "error" in row:
                rows.append([kname, "ERROR " + row["error"], "", "", ""])
                continue
            cells = []
            for mname in ("all allowed", "10 allowed", "random half"):
                ok = "" if row.get(mname + " correct") else " WRONG"
                cells.append(f"{row[mname]:.1f}{ok}")
            rows.append([kname, f"{row['first_call_ms']:.1f}"] + cells)
        p(table(["kernel", "first call ms", "all allowed", "10 allowed", "random half"], rows))
        busy = a.get("cpu_busy_before")
        if busy is not None and busy >= 0:
            p(f"(CPU busy before: {busy:.0%})")

    if cov:
        p("\n## JSON-Schema coverage (engine defaults; each schema checked as property v of a closed object, "
      "instances compact JSON)\n")
        names = [e for e in ENGINES if e in cov]
        feats = [f for f, *_ in COVERAGE]
        rows = []
        for i, f in enumerate(feats):
            row = [f]
            for e in names:
                r = cov[e]
                if not r.get("ok"):
                    row.append("worker failed: " + r.get("error", "")[:80])
                else:
                    row.append(verdict(r["coverage"][i]))
            rows.append(row)
        p(table(["feature"] + names, rows))
        p("\n## invalid schemas\n")
        rows = []
        for i, (case, schema) in enumerate(INVALID_SCHEMAS):
            rows.append([case + " " + compact(schema)] + [
                (cov[e]["invalid_schemas"][i]["result"][:160] if cov[e].get("ok") else "-") for e in names])
        p(table(["schema"] + names, rows))
        p("\n## grammar syntax, and raw-text checks\n")
        rows = []
        for i, (case, kind, *_rest) in enumerate(SYNTAX):
            row = [case]
            for e in names:
                if not cov[e].get("ok"):
                    row.append("-")
                    continue
                s = cov[e]["syntax"][i]
                if "error" in s:
                    row.append(s["error"][:160])
                else:
                    row.append(verdict(s))
            rows.append(row)
        p(table(["grammar"] + names, rows))
    failures = [r for r in results if not r.get("ok")]
    if failures:
        p("\n## failures\n")
        for r in failures:
            p(f"- {r['engine']} {r.get('task')} {r.get('grammar') or ''}: {r.get('error')}")
            if r.get("traceback"):
                p("  " + r["traceback"].strip().splitlines()[-1][:300])
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: " + ", ".join(ENGINES))
    ap.add_argument("--grammars", default=",".join(GRAMMARS), help="comma-separated: " + ", ".join(GRAMMARS))
    ap.add_argument("--tokens", type=int, default=300, help="max tokens per greedy walk (stops earlier at EOS)")
    ap.add_argument("--walks", type=int, default=3, help="walks per engine and grammar (seeds seed, seed+1, ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--layout", choices=("oneline", "compact", "flexible"), default="oneline",
                    help="JSON layout of the perf runs: oneline = qvl's ', ' and ': ' without free whitespace")
    ap.add_argument("--model", default="/work/ckpt/qvl-2b", help="folder with tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=151936, help="logits width")
    ap.add_argument("--sections", default="perf,coverage,apply",
                    help="perf (compile, per token, state, threads), coverage (schemas, grammars), apply (kernels alone)")
    ap.add_argument("--no-state", dest="state", action="store_false", help="skip the state and thread tests")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per worker process")
    ap.add_argument("--mem-limit-gb", type=float, default=8, help="address-space limit per worker (0: none)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="before each timed worker, wait up to this many seconds for the CPUs to be idle")
    ap.add_argument("--idle-threshold", type=float, default=0.15, help="'idle': share of CPU time busy below this")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--from-json", help="print the tables from saved results instead of measuring: comma-separated "
                                        "files, a later file's result for the same engine/task/grammar wins")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--grammar", help=argparse.SUPPRESS)
    ap.add_argument("--skip-cases", help=argparse.SUPPRESS)
    ap.add_argument("--skip-reasons", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        worker_main(args)
        return
    if args.from_json:
        merged = {}
        for path in args.from_json.split(","):
            with open(path) as f:
                for r in json.load(f):
                    merged[(r.get("engine"), r.get("task"), r.get("grammar"))] = r
        order = {e: i for i, e in enumerate(ENGINES)}
        results = sorted(merged.values(), key=lambda r: (r.get("task") == "apply", order.get(r.get("engine"), 9),
                                                         list(GRAMMARS).index(r["grammar"]) if r.get("grammar") in GRAMMARS
                                                         else 9))
        print(report(results, args))
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ADAPTERS:
            ap.error(f"unknown engine {e}")
    grammars = [g.strip() for g in args.grammars.split(",") if g.strip()]
    sections = set(args.sections.split(","))
    results = []
    for e in engines:
        if "perf" in sections:
            for g in grammars:
                print(f"... {e} perf {g}", file=sys.stderr, flush=True)
                r = run_worker(args, e, "perf", g)
                print(f"    {'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))[:200]} ({r['wall_s']:.0f} s)",
                      file=sys.stderr, flush=True)
                results.append(r)
        if "coverage" in sections:
            print(f"... {e} coverage", file=sys.stderr, flush=True)
            r = run_coverage(args, e)
            print(f"    {'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))[:200]} ({r['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
            results.append(r)
    if "apply" in sections:
        print("... mask application kernels", file=sys.stderr, flush=True)
        r = run_worker(args, "-", "apply")
        print(f"    {'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))[:200]} ({r['wall_s']:.0f} s)",
              file=sys.stderr, flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(report(results, args))


if __name__ == "__main__":
    main()
