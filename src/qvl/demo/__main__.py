"""`python -m qvl.demo data|train|pack|path`: draw a labelled set, train a small model, pack a
trained one for the package, or print where a shipped one is."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qvl.demo import data



def cmd_data(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise ValueError("--count must be at least 1")
    labels = data.write_set(Path(args.out), args.seed, args.count, args.task)
    print(f"wrote {args.count} item(s) and {labels}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from qvl.demo.train import TrainConfig, train

    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, lr=args.lr, warmup=args.warmup,
                         vision_lr=args.vision_lr, vision_steps=args.vision_steps, probe_weight=args.probe_weight,
                         attend_weight=args.attend_weight, turns=args.turns, arch=args.arch,
                         finish_steps=args.finish_steps, finish_lr=args.finish_lr,
                         finish_vision_lr=args.finish_vision_lr,
                         eval_every=args.eval_every, eval_items=args.eval_items, save_every=args.save_every,
                         log_every=args.log_every, threads=args.threads, groups=args.groups, minutes=args.minutes)
    out = train(Path(args.out), config)
    print(f"wrote the trained checkpoint to {out}")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from qvl.demo.pack import pack

    print(f"wrote the packed checkpoint to {pack(Path(args.trained), Path(args.dest))}")
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    from qvl.demo import shipped

    print(shipped.folder(args.arch))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from qvl.demo.train import ARCHITECTURES, TrainConfig

    def _per_arch(field: str) -> str:  # an Architecture field's default per architecture, for the help
        return ", ".join(f"{name} {getattr(arch, field)}" for name, arch in ARCHITECTURES.items())

    parser = argparse.ArgumentParser(prog="python -m qvl.demo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("data", help="draw a labelled set (PNG files and labels.jsonl, qvl eval's format)")
    p.add_argument("--out", required=True, help="folder for the images and labels.jsonl")
    p.add_argument("--seed", type=int, default=0, help="the set drawn (the same items on every machine)")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--task", choices=data.TASK_NAMES, help="only this task (default: the training mix)")
    p.set_defaults(run=cmd_data)

    d = TrainConfig()
    p = sub.add_parser("train", help="train the small Qwen3-VL-shaped model from scratch (resumes from OUT/train)")
    p.add_argument("out", help="checkpoint folder (official layout); its train/ subfolder keeps the state to resume")
    p.add_argument("--steps", type=int,
                   help=f"steps before the finishing ones (default: the architecture's: {_per_arch('steps')})")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed, help="weights and the training items (deterministic)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW; cosine to a tenth)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps of linear warm-up")
    p.add_argument("--vision-lr", type=float, default=d.vision_lr, help="the vision tower's learning rate, times --lr")
    p.add_argument("--vision-steps", type=int,
                   help="first steps that train the vision tower alone, from the vision probe (~3x cheaper each; "
                        f"default: the architecture's: {_per_arch('vision_steps')})")
    p.add_argument("--probe-weight", type=float, default=d.probe_weight,
                   help="weight of the vision probe's loss (0: the answers' loss alone)")
    p.add_argument("--attend-weight", type=float, default=d.attend_weight,
                   help="weight of the target that one attention head looks at the shapes a question names "
                        "(qwen3-vl; 0: none)")
    p.add_argument("--finish-steps", type=int,
                   help="steps after --steps on a mix weighted to scenes, at their own learning rate (default: the "
                        f"architecture's: {_per_arch('finish_steps')})")
    p.add_argument("--finish-lr", type=float, default=d.finish_lr,
                   help="the finishing steps' peak learning rate (a warm-up, then a cosine to a tenth)")
    p.add_argument("--finish-vision-lr", type=float, default=d.finish_vision_lr,
                   help="the vision tower's learning rate in the finishing steps, times --finish-lr (0: frozen)")
    p.add_argument("--turns", type=int, help="questions per scene in one training conversation (default: the "
                   f"architecture's: {_per_arch('turns')}; Qwen3.5's template re-renders earlier turns without their "
                   "reasoning)")
    p.add_argument("--arch", choices=list(ARCHITECTURES), default=d.arch,
                   help="the checkpoint's architecture: Qwen3-VL, or Qwen3.5's hybrid Gated DeltaNet one")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out exact-match checks "
                   "(after the vision-only steps)")
    p.add_argument("--eval-items", type=int, default=d.eval_items, help="held-out items per check")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between resumable states")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between loss and speed lines")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--groups", type=int, default=d.groups,
                   help="run each batch as up to this many padded batches of similar lengths (less padding)")
    p.add_argument("--minutes", type=float, help="stop (saving) after this much wall time; run again to go on")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("pack", help="the trained checkpoint as the package ships it: int8 (vision tower too), the "
                                    "embedding rows its training never read set to their mean, xz-compressed")
    p.add_argument("trained", help="the folder `train` wrote")
    p.add_argument("dest", help="folder for its side files and model.safetensors.xz")
    p.set_defaults(run=cmd_pack)

    p = sub.add_parser("path", help="print the folder of a shipped demo checkpoint, ready to load (its tokenizer "
                                    "files written to qvl's cache the first time)")
    p.add_argument("--arch", choices=list(ARCHITECTURES), default="qwen3-vl", help="which one")
    p.set_defaults(run=cmd_path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as exc:  # FileNotFoundError too
        print(f"python -m qvl.demo {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
