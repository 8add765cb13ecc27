"""Rasterising PDF pages at the image budget: the time from PDF bytes to the page image qvl
encodes, per page, at the OCR preset's budget (1024 tokens, about one megapixel) and the
default (256).

    python benchmarks/pdf.py --pages 20 --rounds 5

The document is written here: --pages A4 pages, each a 300 dpi scan (2480 x 3508 JPEG, as a
scanner writes them: the hard case, every page's image is decoded and scaled) holding lines
of text, saved as one PDF by Pillow (a scan is what OCR users bring). Each round draws
every page once (open, render, convert to RGB) with `qvl.processing.pdf.render_pages`, one
page per call as `qvl batch` does, in a fresh order; printed per round, then the median and
min-max per page.
"""

from __future__ import annotations

import argparse
import io
import random
import time

from PIL import Image, ImageDraw, ImageFont

import common
from qvl.processing.pdf import render_pages


def scanned_page(number: int, rng: random.Random) -> Image.Image:
    """An A4 page scanned at 300 dpi (2480 x 3508): 70 lines of random words, numbered."""
    font = ImageFont.load_default(size=38)
    page = Image.new("RGB", (2480, 3508), (250, 248, 240))
    pen = ImageDraw.Draw(page)
    for line in range(70):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(rng.randint(6, 12)))
        pen.text((200, 200 + line * 44), f"{number}.{line + 1} {words}", fill=(20, 20, 20), font=font)
    return page


def scanned_pdf(pages: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    images = [scanned_page(k + 1, rng) for k in range(pages)]
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=300, quality=85)
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 256], help="image tokens (32 x 32 pixels each)")
    args = p.parse_args()
    data = scanned_pdf(args.pages)
    print(f"{args.pages} scanned A4 pages at 300 dpi: {len(data) / 2**20:.1f} MB")
    for tokens in args.budgets:
        times, size = [], None
        for r in range(args.rounds):
            order = list(range(1, args.pages + 1))
            random.Random(r).shuffle(order)
            this_round = []
            for n in order:
                started = time.perf_counter()
                (page,) = render_pages(data, str(n), max_pixels=tokens * 1024)
                this_round.append((time.perf_counter() - started) * 1000)
                size = page.size
            times += this_round
            print(f"  {tokens} tokens, round {r + 1}: {common.spread(this_round, '{:.1f}')} ms per page", flush=True)
        print(f"{tokens} tokens ({size[0]}x{size[1]} pixels): {common.spread(times, '{:.1f}')} ms per page "
              f"({len(times)} pages drawn)")


if __name__ == "__main__":
    main()
