"""Plots for docs/benchmarks.md from the JSON that benchmarks/compare.py writes.

    python benchmarks/plots.py docs/bench-results.json docs/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def vision_vs_budget(results: dict, out: Path) -> None:
    budgets = [int(b) for b in results["vision_vs_budget"]]
    ms = list(results["vision_vs_budget"].values())
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(budgets, [m / 1000 for m in ms], "o-", label="qvl vision encoder")
    tf = results["transformers"]
    ax.plot([tf["seed_384"]["image_tokens"], tf["full_budget"]["image_tokens"]],
            [tf["seed_384"]["vision_ms"] / 1000, tf["full_budget"]["vision_ms"] / 1000], "s--",
            label="transformers bf16")
    for b, m in zip(budgets, ms):
        side = int((b * 1024) ** 0.5)
        ax.annotate(f"~{side}²", (b, m / 1000), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xlabel("image tokens (pixel budget / 32²)")
    ax.set_ylabel("seconds")
    ax.set_title("Vision encoder time against the image budget (1920x1080 photo)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "vision-vs-budget.png", dpi=110)


def decode_vs_floor(results: dict, out: Path) -> None:
    bw = results["machine"]["read_gb_s"]
    wb = results["weight_bytes"]
    names = ["transformers bf16"] + [f"qvl {f}" for f in results["qvl"]]
    measured = [results["transformers"]["decode"]["decode_ms_per_token"]] + [
        q["default"]["decode_ms_per_token"] for q in results["qvl"].values()]
    floors = [wb["bf16"] / bw / 1e6] + [wb[results["floor_format"][f]] / bw / 1e6 for f in results["qvl"]]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured ms/token")
    ax.bar([x + 0.2 for x in xs], floors, 0.4, label=f"floor: weight bytes / {bw:.0f} GB/s")
    ax.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax.set_ylabel("ms per decoded token")
    ax.set_title("Decode speed per weight format against its bandwidth floor")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode-vs-floor.png", dpi=110)


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    vision_vs_budget(results, out)
    decode_vs_floor(results, out)


if __name__ == "__main__":
    main()
