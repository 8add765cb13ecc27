"""What constrained decoding (structured outputs) costs: the decode step of a JSON-schema
answer against the same number of free tokens, and compiling a typical invoice schema.

    python benchmarks/structured.py --model /work/ckpt/qvl-2b --rounds 5

Per round, alternating the order: one answer constrained to a schema that forces a long
string (so the answer runs ~N tokens), then the same prompt unconstrained for exactly as
many tokens (EOS ignored); the ratio of their decode ms/token (medians over rounds, with
min-max). With --rows R, R such requests run together (the scheduler masks each row).
Then: the invoice schema compiled cold, up to its first token's mask (a fresh grammar cache
over a built tokenizer index; the index's own one-time build is reported apart), and again
(cached: what a later request pays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import common
from qvl.engine import Engine, EngineOptions, Request
from qvl.grammar import Constraint, Grammars

LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 600, "maxLength": 700}},
               "required": ["text"]}

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"}, "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
    "country": {"type": "string", "minLength": 2, "maxLength": 2}}, "required": ["street", "city", "country"]}
PARTY = {"type": "object", "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                                          "vat_id": {"type": ["string", "null"]}}, "required": ["name", "address"]}
INVOICE = {
    "$defs": {"address": ADDRESS, "party": PARTY},
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^[A-Z0-9-]{3,20}$"},
        "issue_date": {"type": "string", "format": "date"},
        "due_date": {"type": ["string", "null"], "format": "date"},
        "currency": {"enum": ["EUR", "USD", "GBP", "CNY", "JPY", "CHF"]},
        "seller": {"$ref": "#/$defs/party"},
        "buyer": {"$ref": "#/$defs/party"},
        "line_items": {"type": "array", "minItems": 1, "maxItems": 50, "items": {
            "type": "object", "properties": {
                "description": {"type": "string", "maxLength": 200},
                "quantity": {"type": "number", "minimum": 0},
                "unit": {"enum": ["pcs", "h", "kg", "m", "l"]},
                "unit_price": {"type": "number"},
                "vat_rate": {"type": "number", "minimum": 0, "maximum": 100},
                "total": {"type": "number"}},
            "required": ["description", "quantity", "unit_price", "total"]}},
        "subtotal": {"type": "number"},
        "tax_total": {"type": "number"},
        "total": {"type": "number"},
        "paid": {"type": "boolean"},
        "payment_terms": {"type": ["string", "null"]},
        "iban": {"type": ["string", "null"], "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"},
        "notes": {"type": "string", "maxLength": 500},
    },
    "required": ["invoice_number", "issue_date", "currency", "seller", "buyer", "line_items", "total"],
}


def decode_ms(engine: Engine, rows: int, constrained: bool, tokens: int | None, seed: int) -> tuple[float, int]:
    """(median decode ms per step, tokens of the first answer)."""
    sampling = engine.sampling_defaults(temperature=1.0, seed=seed, max_new_tokens=tokens or 1024,
                                        constraint=Constraint.json(LONG_STRING) if constrained else None,
                                        ignore_eos=None if constrained else True)
    requests = [Request([{"role": "user", "content": f"Write a long paragraph about the sea ({r})."}], sampling)
                for r in range(rows)]
    dones = engine.generate_batch(requests)
    per_token = statistics.median(statistics.median(d.timings.decode_ms) for d in dones)
    return per_token, len(dones[0].token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=1)
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, weights=args.weights, threads=args.threads,
                                       answer_cache_entries=0, prefix_cache_mb=0))
    started = time.perf_counter()
    engine.grammars.index()
    index_s = time.perf_counter() - started
    decode_ms(engine, args.rows, True, None, 0)  # warm both paths
    ratios, free, fixed = [], [], []
    for rnd in range(args.rounds):
        order = (True, False) if rnd % 2 == 0 else (False, True)
        seen = {}
        tokens = None
        for constrained in order:
            if constrained:
                seen[True], tokens_c = decode_ms(engine, args.rows, True, None, rnd)
                tokens = tokens_c
            else:
                seen[False], _ = decode_ms(engine, args.rows, False, tokens or 160, rnd)
        fixed.append(seen[True])
        free.append(seen[False])
        ratios.append(seen[True] / seen[False])
        print(f"round {rnd + 1}: constrained {seen[True]:.2f} ms/token, free {seen[False]:.2f} ms/token, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"rows {args.rows}: constrained {common.spread(fixed)} ms/token, free {common.spread(free)} ms/token, "
          f"constrained/free {common.spread(ratios)}")

    index = engine.grammars.index()
    cold, warm = [], []
    for _ in range(5):
        grammars = Grammars(engine.tokenizer, engine.cfg.text.vocab_size, engine.defaults.eos_token_ids)
        grammars._index = index  # the tokenizer index is built once per process (reported above)
        started = time.perf_counter()
        grammars.guide(Constraint.json(INVOICE)).mask(torch.zeros(1, engine.cfg.text.vocab_size))
        cold.append((time.perf_counter() - started) * 1000)  # compiled, and its first mask (lazy parts built)
        started = time.perf_counter()
        grammars.guide(Constraint.json(INVOICE))  # what a request pays once compiled: a copy
        warm.append((time.perf_counter() - started) * 1000)
    fields = json.dumps(INVOICE).count('"type"')
    print(f"tokenizer index (once per process): {index_s * 1000:.0f} ms")
    print(f"invoice schema ({fields} typed fields): first compile {common.spread(cold)} ms, "
          f"again {common.spread(warm)} ms")
    print(json.dumps({"rows": args.rows, "ratio_median": statistics.median(ratios), "ratios": ratios,
                      "constrained_ms": fixed, "free_ms": free, "index_ms": index_s * 1000,
                      "compile_cold_ms": cold, "compile_warm_ms": warm, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
