"""Each configuration of an evaluation: its engine answers every item through the batch path
(Worker on the scheduler, `batch_size` items in flight, as `qvl batch` runs them), greedily;
the answers are scored as they come. A configuration on another CPU tier runs in a process of
its own (QVL_ISA is read once per process): `python -m qvl.eval.run SPEC OUT`."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from qvl.batch.process import Worker
from qvl.batch.progress import Progress
from qvl.engine import Engine, EngineOptions
from qvl.eval.labels import Label
from qvl.eval.metrics import score, summary
from qvl.options import SamplingOptions


@dataclass(frozen=True)
class Configuration:
    weights: str
    int8_activations: str
    isa: str | None = None  # a CPU tier (QVL_ISA), None: this machine's

    @property
    def name(self) -> str:
        parts = [self.weights]
        if self.int8_activations != "auto":
            parts.append(f"act={self.int8_activations}")
        if self.isa:
            parts.append(f"isa={self.isa}")
        return " ".join(parts)


@dataclass(frozen=True)
class Job:
    """Everything a configuration's run needs; picklable (a tier's process gets it in a file)."""

    labels: list[Label]
    options: EngineOptions  # weights and activations as the configuration says
    sampling: SamplingOptions
    batch_size: int
    configuration: Configuration


def configurations(weights: str, activations: str, isas: str | None) -> list[Configuration]:
    """Every combination of the comma-separated lists, in the order given."""
    def split(value: str | None) -> list:
        return [v.strip() for v in value.split(",") if v.strip()] if value else [None]

    return [Configuration(w, a, i) for w, a, i in itertools.product(split(weights), split(activations), split(isas))]


def evaluate(job: Job) -> dict:
    """Load, answer every label, score: the configuration's summary, speed and items."""
    started = time.perf_counter()
    engine = Engine.load(job.options)
    loaded = time.perf_counter()
    worker = Worker(engine, job.sampling.params(engine), None, job.batch_size)
    progress = Progress(len(job.labels), name=f"qvl eval ({job.configuration.name})")
    scored, tokens, first_token_ms = [], 0, []
    for label, row in zip(job.labels, worker.rows(label.item for label in job.labels), strict=True):
        answer = row.get("text") if "error" not in row else None
        item = {"id": label.item.id, "line": label.line, "kind": label.kind, "answer": answer,
                "expected": label.answer, **score(answer, label.answer, label.kind)}
        if "error" in row:
            item["error"] = row["error"]
        else:
            tokens += row["usage"]["completion_tokens"]
            first_token_ms.append(row["timings"]["ttft_ms"])
        scored.append(item)
        progress.update("error" not in row)
    progress.close()
    seconds = time.perf_counter() - loaded
    speed = {"load_s": round(loaded - started, 2), "answer_s": round(seconds, 2),
             "items_per_s": round(len(scored) / seconds, 3), "answer_tokens_per_s": round(tokens / seconds, 1),
             "mean_first_token_ms": round(sum(first_token_ms) / len(first_token_ms), 1) if first_token_ms else None}
    plan = engine.plan
    resolved = {"tier": plan.library.tier.name, "dtype": str(plan.dtype).replace("torch.", ""),
                "weights": plan.weights, "vision_int8": plan.vision_int8, "int8_activations": plan.activations}
    return {"configuration": {"name": job.configuration.name, **asdict(job.configuration), "resolved": resolved},
            "summary": summary(scored), "speed": speed, "items": scored}


def run(job: Job) -> dict:
    """`evaluate` here, or in a process of its own when the configuration names a CPU tier."""
    if job.configuration.isa is None:
        return evaluate(job)
    with tempfile.TemporaryDirectory(prefix="qvl-eval-") as folder:
        spec, out = os.path.join(folder, "job.pickle"), os.path.join(folder, "result.json")
        with open(spec, "wb") as f:
            pickle.dump(job, f)
        env = {**os.environ, "QVL_ISA": job.configuration.isa}
        done = subprocess.run([sys.executable, "-m", "qvl.eval.run", spec, out], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the configuration '{job.configuration.name}' failed (exit status {done.returncode})")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def main(spec: str, out: str) -> int:
    with open(spec, "rb") as f:
        job = pickle.load(f)
    result = evaluate(job)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
