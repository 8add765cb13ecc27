"""The Ray backend: the same rows, computed by a Ray Data actor pool (one engine per actor).

The driver keeps everything that makes resume safe: it reads the inputs, skips done ids,
and writes each row that streams back through the same results file as the local path.
Image and video paths must be readable on every node (a shared file system) and qvl installed there.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import asdict

from qvl.batch.inputs import Item, UsageError
from qvl.batch.process import WorkSpec, Worker

INSTALL_HINT = "--ray needs Ray Data: pip install 'qvl[ray]'  (or: pip install 'ray[data]')"


def import_ray():
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise UsageError(INSTALL_HINT) from exc
    return ray


class RayWorker:
    """An actor: loads one engine, then answers one Ray Data batch of items per call."""

    def __init__(self, spec: WorkSpec):
        self.worker = Worker.from_spec(spec)

    def __call__(self, batch: dict) -> dict:
        items = [Item(str(i), str(path), prompt if isinstance(prompt, str) else None, str(kind),
                      int(page) if page is not None and page == page else None)  # a missing page may come as NaN
                 for i, path, prompt, kind, page in zip(batch["id"], batch["path"], batch["prompt"], batch["kind"],
                                                        batch["page"])]
        return {"row": [json.dumps(row, ensure_ascii=False) for row in self.worker.rows(items)]}


def quiet_console(logger: logging.Logger) -> None:
    """Ray Data's progress bars and INFO lines off the terminal (our progress is on the driver);
    its warnings stay, and its log files keep everything."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(max(handler.level, logging.WARNING))


def ray_rows(spec: WorkSpec, items: list[Item], *, address: str | None = None, actors: int = 1) -> Iterator[dict]:
    """Rows from `actors` actors of `spec.options.threads` CPUs each. Uses the Ray instance
    already initialised in this process, else connects to `address` (None: $RAY_ADDRESS or a
    new local instance, shut down at the end)."""
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        quiet_console(logging.getLogger("ray.data"))
        blocks = math.ceil(len(items) / spec.batch_size)
        ds = ray.data.from_items([asdict(item) for item in items], override_num_blocks=blocks)
        ds = ds.map_batches(RayWorker, fn_constructor_args=(spec,), batch_size=spec.batch_size,
                            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=spec.options.threads or 1)
        for record in ds.iter_rows():
            yield json.loads(record["row"])
    finally:
        if started_here:
            ray.shutdown()
