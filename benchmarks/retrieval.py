"""Embedding and reranker models: qvl against the official method run on transformers, and
`qvl index add` killed part-way and resumed. Prints markdown tables; its files go to a
temporary folder.

    PYTHONPATH=src .venv/bin/python benchmarks/retrieval.py [--parts embed,rerank,index] [--rounds 3]
    PYTHONPATH=src .venv/bin/python benchmarks/retrieval.py --preset embedding-tiny --ckpt-dir /tmp/ckpt \\
        --inputs 2 --pairs 3 --pages 8 --pdfs 2 --rounds 1      # a check that every part runs

The checkpoints are <ckpt-dir>/qvl-<preset> and the reranker of the same size (embedding-2b:
qvl-reranker-2b), written by `qvl synth` when missing: random weights, timed faithfully (the
work is the model's shape, not its values). Every side gets the same threads and the same
image budget, --image-tokens (qvl's default, 256; the official code allows up to 1,800:
--image-tokens 1800 compares at its resolution).

embed   Inputs/s over --inputs photos (--photo, JPEG) and as many scanned A4 pages (2480 x 3508
        JPEG, benchmarks/pdf.py's), each side from the files to the vectors:
          qvl        qvl.retrieval.encode.embed, what /v1/embeddings and `qvl embed` run: all the
                     inputs in one call, on the scheduler's rows (8);
          reference  the official Qwen3-VL-Embedding method on transformers: Qwen3VLModel
                     (--reference-dtype), the chat template with the generation prompt, the image
                     processor resizing to the budget, batches of --batch right-padded, the last
                     real token's final-normed hidden state L2-normalised;
          qvl TTFT   qvl's generation path on the same prompts and weights, one request at a
                     time as a user asks (Engine.generate of one token): inputs / the sum of the
                     first-token times.
        qvl's caches are off: every round embeds the same files.
rerank  Pairs/s over one query and --pairs scanned pages: qvl.retrieval.encode.rerank (the
        /v1/rerank path) against the official reranker on transformers, one pair at a time as
        it scores them (sigmoid of the last position's hidden state times lm_head's "yes" row
        minus its "no" row). qvl's vision cache is off (the pages come back each round) and each
        round's query is new (its prefix cache shares the query's prefix within a round only).
index   `qvl index add` (the CLI, a process of its own) over --pdfs PDFs holding --pages scanned
        pages in all: a full run's pages/s; then a run killed with SIGKILL once --kill-at of the
        pages are committed, and the same command again, which must embed exactly the pages the
        killed run had not committed (its summary's counts) and leave each page once, --pages
        entries in all.

Before any timing each part checks that qvl and the reference agree on one input of each kind
(the cosine of the vectors, or of the reranker's last hidden states, at least --min-cosine, and
the scores within 0.05), so a broken path cannot look fast. The sides run in an order rotated
each round; a ratio is the median of the rounds' own ratios. sentence-transformers is tried
first for the reference; the output says what was used and why.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import signal
import sqlite3
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from pdf import scanned_page, scanned_pdf  # noqa: E402

PARTS = ("embed", "rerank", "index")
MIN_PIXELS = 4 * 32 * 32  # the official code's smallest image
SCORE_TOLERANCE = 0.05
PAD = "<|image_pad|>"
TARGETS = {"reference": 3.0, "qvl TTFT": 1.5}  # qvl's throughput over each side's, as asked of it
NO_CACHES = {"vision_cache_mb": 0, "prefix_cache_mb": 0, "answer_cache_entries": 0}


# -- inputs ----------------------------------------------------------------------------------------

def write_photos(folder: str, n: int, size: str) -> list[str]:
    from qvl.bench import parse_size, synthetic_image

    paths = [os.path.join(folder, f"photo{i}.jpg") for i in range(n)]
    for i, path in enumerate(paths):
        synthetic_image(*parse_size(size), seed=i).save(path, "JPEG", quality=90)
    return paths


def write_pages(folder: str, name: str, n: int, seed: int) -> list[str]:
    """n scanned A4 pages as JPEG files, each its own text."""
    rng, paths = random.Random(seed), [os.path.join(folder, f"{name}{i}.jpg") for i in range(n)]
    for i, path in enumerate(paths):
        scanned_page(i + 1, rng).save(path, "JPEG", quality=85)
    return paths


def image(path: str) -> list[dict]:
    return [{"type": "image", "image": path}]


def text(value: str) -> list[dict]:
    return [{"type": "text", "text": value}]


# -- the reference ---------------------------------------------------------------------------------

def sentence_transformers_verdict(path: str) -> str:
    """Why the reference is not sentence-transformers (or what it would be)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return "sentence-transformers is not installed"
    try:
        SentenceTransformer(path, local_files_only=True, device="cpu")
    except Exception as e:  # noqa: BLE001 - its reason is the answer
        return f"sentence-transformers cannot load the folder offline ({type(e).__name__}: {str(e)[:160]})"
    return ("sentence-transformers loads the folder, but resizes images by its processor's own settings, "
            "not --image-tokens; its modules (Transformer, last-token Pooling, Normalize) are the pooling below")


class Reference:
    """The official Qwen3-VL-Embedding / Qwen3-VL-Reranker method (QwenLM/Qwen3-VL-Embedding,
    src/models) on transformers, its images resized by the image processor to the budget."""

    def __init__(self, path: str, dtype: str, image_tokens: int, reranker: bool):
        import transformers
        from transformers import AutoImageProcessor, AutoTokenizer

        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        cls = transformers.Qwen3VLForConditionalGeneration if reranker else transformers.Qwen3VLModel
        model = cls.from_pretrained(path, dtype=torch_dtype).eval()
        self.body = model.model if reranker else model  # Qwen3VLModel: final-normed hidden states
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = AutoImageProcessor.from_pretrained(path, backend="pil")  # the fast one wants torchvision
        unit = self.processor.patch_size * self.processor.merge_size
        self.size = {"shortest_edge": MIN_PIXELS, "longest_edge": image_tokens * unit**2}
        self.pad_id = self.tokenizer.convert_tokens_to_ids(PAD)
        if reranker:
            rows = model.lm_head.weight.float()
            yes, no = (self.tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
            self.yes_no = rows[yes] - rows[no]
        self.label = f"transformers {transformers.__version__} {dtype}"

    def batch(self, conversations: list[list[dict]], paths: list[str], padding_side: str) -> dict:
        """The processor's inputs: each conversation (holding one image) through the chat template
        with the generation prompt, its image's pad token repeated for its tokens, padded."""
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                 for c in conversations]
        pixels = self.processor(images=[Image.open(p).convert("RGB") for p in paths], size=self.size,
                                return_tensors="pt")
        tokens = (pixels["image_grid_thw"].prod(-1) // self.processor.merge_size**2).tolist()
        self.tokenizer.padding_side = padding_side
        batch = dict(self.tokenizer([t.replace(PAD, PAD * n) for t, n in zip(texts, tokens)], padding=True,
                                    return_tensors="pt"))
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.pad_id).int()
        return {**batch, **pixels}

    @torch.inference_mode()
    def embed(self, paths: list[str]) -> torch.Tensor:
        """Qwen3VLEmbedder.process: [N, D] float32, the last real token's state L2-normalised."""
        from qvl.retrieval.prompts import EMBED_INSTRUCTION

        system = {"role": "system", "content": text(EMBED_INSTRUCTION)}
        batch = self.batch([[system, {"role": "user", "content": [{"type": "image"}]}] for _ in paths], paths,
                           "right")
        hidden = self.body(**batch).last_hidden_state
        mask = batch["attention_mask"]
        last = mask.shape[1] - mask.flip(dims=[1]).argmax(dim=1) - 1
        return F.normalize(hidden[torch.arange(len(paths)), last].float(), p=2, dim=-1)

    @torch.inference_mode()
    def score(self, query: str, path: str) -> tuple[float, torch.Tensor]:
        """Qwen3VLReranker's score of one (query, page) pair, and the hidden state [D] it comes from."""
        from qvl.retrieval.prompts import RERANK_INSTRUCTION, RERANK_SYSTEM

        user = [*text(f"<Instruct>: {RERANK_INSTRUCTION}"), *text("<Query>:"), *text(query), *text("\n<Document>:"),
                {"type": "image"}]
        batch = self.batch([[{"role": "system", "content": text(RERANK_SYSTEM)}, {"role": "user", "content": user}]],
                           [path], "left")
        h = self.body(**batch).last_hidden_state[0, -1].float()
        return torch.sigmoid(h @ self.yes_no).item(), h


def agreement(name: str, cosine: float, args) -> str:
    """A parity line; SystemExit when the sides disagree (a broken path must not be timed)."""
    line = f"parity, {name}: cosine {cosine:.5f}"
    if cosine < args.min_cosine:
        raise SystemExit(f"{line} < --min-cosine {args.min_cosine}: qvl and the reference disagree, not timing")
    return line


# -- the parts -------------------------------------------------------------------------------------

def engine_options(args, model: str, **overrides):
    from qvl.engine import EngineOptions

    return EngineOptions(model=model, threads=args.threads, max_image_tokens=args.image_tokens, **overrides)


def rounds_of(sides: dict, rounds: int, unit: str) -> dict[str, list[float]]:
    """Each side's rate once per round, the sides in an order rotated each round."""
    results = {name: [] for name in sides}
    for r, order in common.rotations(list(sides), rounds):
        for name in order:
            results[name].append(sides[name]())
            print(f"round {r + 1}, {name}: {results[name][-1]:.3f} {unit}", flush=True)
    return results


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def embed_part(args, folder: str) -> list[str]:
    from qvl.engine import Engine, Request
    from qvl.retrieval.encode import embed
    from qvl.retrieval.prompts import embedding_messages
    from qvl.retrieval.task import GENERATE
    from qvl.sampling import SamplingParams

    kinds = {f"{args.photo} photos": write_photos(folder, args.inputs, args.photo),
             "scanned A4 pages": write_pages(folder, "page", args.inputs, seed=1)}
    engine = Engine.load(engine_options(args, args.model, **NO_CACHES))
    chat = Engine.load(engine_options(args, args.model, **NO_CACHES))
    chat.task = GENERATE  # the same weights answering chat requests: the generation path on the same prompts
    for e in (engine, chat):
        e.warm_up()
    reference = Reference(args.model, args.reference_dtype, args.image_tokens, reranker=False)
    torch.set_num_threads(args.threads)

    def first_token(path: str) -> float:
        return timed(lambda: chat.generate(Request(embedding_messages(image(path)), SamplingParams(max_new_tokens=1))))

    out = []
    for kind, paths in kinds.items():  # parity, and every side's first pass over the weights
        ours, tokens = embed(engine, [image(paths[0])])
        theirs = reference.embed(paths[:1])
        out.append(agreement(f"{kind}, qvl against the reference ({tokens} prompt tokens)",
                             F.cosine_similarity(ours, theirs).item(), args))
        first_token(paths[0])

    def sides(paths: list[str]) -> dict:
        """Each side's inputs/s over `paths`."""
        batches = [paths[i: i + args.batch] for i in range(0, len(paths), args.batch)]
        return {"qvl": lambda: len(paths) / timed(lambda: embed(engine, [image(p) for p in paths])),
                "reference": lambda: len(paths) / timed(lambda: [reference.embed(b) for b in batches]),
                "qvl TTFT": lambda: len(paths) / sum(first_token(p) for p in paths)}

    results = {kind: rounds_of(sides(paths), args.rounds, f"{kind}/s") for kind, paths in kinds.items()}
    out += [f"\n### Embedding throughput: {args.inputs} inputs of each kind, {args.image_tokens}-token image budget, "
            f"{args.rounds} round(s)\n", ratio_table(results, "inputs/s", "qvl TTFT")]
    return out


def ratio_table(results: dict, unit: str, *others: str) -> str:
    """A row per workload: each side's rate, and qvl's over the reference's (and the others')."""
    header = ["workload", *[f"{side} {unit}" for side in next(iter(results.values()))]]
    header += [f"qvl / {side} (target)" for side in ("reference", *others)]
    rows = []
    for workload, sides in results.items():
        row = [workload, *[common.spread(rates, "{:.3f}") for rates in sides.values()]]
        for side in ("reference", *others):
            r = common.round_ratio(sides["qvl"], sides[side])
            row.append(f"{r:.2f}x (>= {TARGETS[side]}x: {'met' if r >= TARGETS[side] else 'NOT met'})")
        rows.append(row)
    return common.markdown_table(header, rows)


def rerank_part(args, folder: str) -> list[str]:
    from qvl.engine import Engine
    from qvl.retrieval.encode import answered, parse_pair, relevance, rerank, score_vector

    pages = write_pages(folder, "doc", args.pairs, seed=2)
    engine = Engine.load(engine_options(args, args.reranker, vision_cache_mb=0, answer_cache_entries=0))
    engine.warm_up()
    reference = Reference(args.reranker, args.reference_dtype, args.image_tokens, reranker=True)
    torch.set_num_threads(args.threads)
    query = "the page that states the delivery terms and carries the signature"
    (done,) = answered(engine.generate_batch([parse_pair(engine, text(query), image(pages[0]))]))
    our_score = relevance(done.hidden, score_vector(engine))
    their_score, hidden = reference.score(query, pages[0])
    out = [agreement(f"reranker's last hidden state, qvl against the reference (scores {our_score:.4f} and "
                     f"{their_score:.4f})", F.cosine_similarity(done.hidden.float(), hidden, dim=0).item(), args)]
    if abs(our_score - their_score) > SCORE_TOLERANCE:
        raise SystemExit(f"the scores differ by more than {SCORE_TOLERANCE}: not timing")
    asked = iter(range(10**6))  # each measurement its own query: no prefix is reused across rounds

    def ours() -> float:
        q = f"{query} (question {next(asked)})"
        return len(pages) / timed(lambda: rerank(engine, text(q), [image(p) for p in pages]))

    def theirs() -> float:
        q = f"{query} (question {next(asked)})"
        return len(pages) / timed(lambda: [reference.score(q, p) for p in pages])

    results = {f"1 query x {args.pairs} scanned A4 pages": rounds_of({"qvl": ours, "reference": theirs}, args.rounds,
                                                                      "pairs/s")}
    out += [f"\n### Reranking: {args.pairs} (query, page) pairs, {args.image_tokens}-token image budget, "
            f"{args.rounds} round(s)\n", ratio_table(results, "pairs/s")]
    return out


# -- qvl index add, killed and resumed -------------------------------------------------------------

SUMMARY = re.compile(r"added (\d+), already indexed (\d+), skipped (\d+).*?(?:, ([\d.]+) entries/min)?$", re.M)


def committed(db: str) -> list[tuple[str, int]]:
    """(content hash, page) of every entry committed so far (none before the database exists)."""
    try:
        with sqlite3.connect(os.path.join(db, "entries.sqlite")) as con:
            return con.execute("SELECT hash, page FROM entries").fetchall()
    except sqlite3.OperationalError:
        return []


def add_command(args, docs: str, db: str) -> list[str]:
    return [sys.executable, "-m", "qvl.cli", "index", "add", docs, "--db", db, "--model", args.model,
            "--max-image-tokens", str(args.image_tokens), "--threads", str(args.threads), "--progress-every", "600"]


def summary_of(done: common.Finished) -> tuple[int, int, float | None]:
    """(added, already indexed, entries/s of its add) from a finished add's summary line."""
    if done.returncode != 0 or not (m := SUMMARY.search(done.stderr)):
        raise RuntimeError(f"qvl index add failed (exit {done.returncode}):\n{done.tail()}")
    return int(m[1]), int(m[2]), float(m[4]) / 60 if m[4] else None


def write_pdfs(docs: str, pages: int, pdfs: int) -> None:
    """`pages` scanned pages in `pdfs` PDFs, each file its own seed (no two pages alike)."""
    os.makedirs(docs)
    for i in range(pdfs):
        with open(os.path.join(docs, f"scans{i}.pdf"), "wb") as f:
            f.write(scanned_pdf(pages // pdfs + (i < pages % pdfs), seed=100 + i))


def killed_then_rerun(args, docs: str, db: str) -> tuple[list, common.Finished, list]:
    """An add killed with SIGKILL once --kill-at of the pages are committed, then run again to
    its end: (the entries committed when killed, the rerun, the entries at the end)."""
    child, kill_at = common.Child(add_command(args, docs, db)), max(1, int(args.pages * args.kill_at))
    while len(committed(db)) < kill_at and child.alive():
        time.sleep(0.05)
    if child.alive():
        os.killpg(child.pid, signal.SIGKILL)
    child.finish(30)
    before = committed(db)
    return before, common.run(add_command(args, docs, db), args.timeout), committed(db)


def index_part(args, folder: str) -> list[str]:
    docs = os.path.join(folder, "docs")
    write_pdfs(docs, args.pages, args.pdfs)
    full = common.run(add_command(args, docs, os.path.join(folder, "full.index")), args.timeout)
    added, _, rate = summary_of(full)
    before, again, after = killed_then_rerun(args, docs, os.path.join(folder, "killed.index"))
    added_again, present, rate_again = summary_of(again)
    checks = {"killed part-way": 0 < len(before) < args.pages,
              f"the rerun embedded only the {args.pages - len(before)} pages not committed":
                  (added_again, present) == (args.pages - len(before), len(before)),
              "every page kept once, none lost":
                  len(after) == len(set(after)) == args.pages and set(before) <= set(after)}
    rows = [["full run", args.pages, added, 0, f"{rate:.3f}" if rate else "-", f"{full.wall_s:.1f}"],
            [f"killed with SIGKILL (--kill-at {args.kill_at})", args.pages, len(before), 0, "-", "-"],
            ["the same command again", args.pages, added_again, present,
             f"{rate_again:.3f}" if rate_again else "-", f"{again.wall_s:.1f}"]]
    out = [f"\n### qvl index add: {args.pages} scanned A4 pages in {args.pdfs} PDFs\n",
           common.markdown_table(["run", "pages", "embedded", "already indexed", "pages/s (add)",
                                  "process wall s (load included)"], rows), ""]
    out += [f"- {name}: {'OK' if ok else 'FAILED'}" for name, ok in checks.items()]
    out.append(f"- entries at the end: {len(after)} (distinct {len(set(after))}); committed when killed: {len(before)}")
    if not all(checks.values()):
        print("\n".join(out))
        raise SystemExit("qvl index add: a check failed (above)")
    return out


# -- the run ---------------------------------------------------------------------------------------

def checkpoints(args) -> None:
    """--model and --reranker, written by qvl synth (--preset and its reranker) when missing."""
    from qvl.synth import write_checkpoint

    reranker_preset = args.preset.replace("embedding", "reranker")
    args.model = args.model or os.path.join(args.ckpt_dir, f"qvl-{args.preset}")
    args.reranker = args.reranker or os.path.join(args.ckpt_dir, f"qvl-{reranker_preset}")
    for path, preset in ((args.model, args.preset), (args.reranker, reranker_preset)):
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"writing the {preset} checkpoint to {path} (qvl synth)", file=sys.stderr, flush=True)
            write_checkpoint(path, preset)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--preset", default="embedding-2b", choices=("embedding-tiny", "embedding-2b", "embedding-8b"),
                   help="the synthetic checkpoints' size (the reranker's follows)")
    p.add_argument("--ckpt-dir", default="/work/ckpt", help="where the checkpoints are (written when missing)")
    p.add_argument("--model", help="the embedding checkpoint (default: <ckpt-dir>/qvl-<preset>)")
    p.add_argument("--reranker", help="the reranker checkpoint (default: <ckpt-dir>/qvl-reranker-<size>)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="every side's (default: all)")
    p.add_argument("--image-tokens", type=int, default=256, help="every side's image budget (qvl's default)")
    p.add_argument("--inputs", type=int, default=8, help="embed: photos, and as many pages")
    p.add_argument("--photo", default="1920x1080", help="embed: the photos' WIDTHxHEIGHT")
    p.add_argument("--batch", type=int, default=8, help="embed: the reference's batch (qvl's rows: 8)")
    p.add_argument("--pairs", type=int, default=100, help="rerank: (query, page) pairs")
    p.add_argument("--pages", type=int, default=200, help="index: pages in all")
    p.add_argument("--pdfs", type=int, default=8, help="index: PDFs holding them")
    p.add_argument("--kill-at", type=float, default=0.3, help="index: share of the pages committed before SIGKILL")
    p.add_argument("--reference-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--min-cosine", type=float, default=0.95, help="parity: the least cosine that passes")
    p.add_argument("--timeout", type=float, default=7200, help="index: seconds one add may take")
    args = p.parse_args()
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        raise SystemExit(f"unknown part: {', '.join(sorted(set(parts) - set(PARTS)))} (see --help)")
    common.stop_on_sigterm()
    checkpoints(args)
    out = [f"{common.cpu_class()}; {args.threads} threads; checkpoints {args.model}, {args.reranker}.",
           f"Reference: the official method on transformers ({args.reference_dtype}) with its pooling; "
           f"{sentence_transformers_verdict(args.model)}."]
    with tempfile.TemporaryDirectory(prefix="qvl-retrieval-") as folder:
        for part in parts:
            out += {"embed": embed_part, "rerank": rerank_part, "index": index_part}[part](args, folder)
            gc.collect()  # the part's models go before the next part's load
    print("\n".join(out))


if __name__ == "__main__":
    main()
