"""Ollama's model management: POST /api/pull (a download into the Hugging Face cache, its
progress streamed as NDJSON) and DELETE /api/delete. Both name models as `qvl pull` does
(hub ids or short names like qwen3-vl:2b); the work is qvl.pull's and qvl.models'."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from qvl.models import find_local, hub_id, remove
from qvl.pull import Progress, pull
from qvl.server.errors import APIError, bad_request
from qvl.server.schemas import _Strict
from qvl.server.state import ServerState

NDJSON = "application/x-ndjson"


class PullBody(_Strict):
    model: str | None = None
    name: str | None = None  # what older clients send
    insecure: bool = False  # accepted; downloads go over the hub's https
    stream: bool = True


class DeleteBody(_Strict):
    model: str | None = None
    name: str | None = None


def model_name(body: PullBody | DeleteBody) -> str:
    name = body.model or body.name
    if not name:
        raise bad_request("model is required", "model")
    try:
        hub_id(name)
    except ValueError as exc:
        raise bad_request(str(exc), "model") from None
    return name


def ollama_line(p: Progress) -> dict:
    """A progress step as Ollama words it."""
    if p.status == "pulling":
        return {"status": f"pulling {p.digest.partition(':')[2][:12]}", "digest": p.digest, "total": p.total,
                "completed": p.completed}
    if p.status == "verifying":
        return {"status": f"verifying {p.digest.partition(':')[0]} digest", "digest": p.digest}
    return {"status": p.status}


class Pulls:
    def __init__(self, state: ServerState):
        self.state = state

    async def pull(self, http: HTTPRequest) -> Response:
        body = PullBody.model_validate_json(await http.body())
        name = model_name(body)
        if body.stream:
            return StreamingResponse(self.progress(name), media_type=NDJSON)
        try:
            await run_in_threadpool(pull, name)
        except (RuntimeError, OSError) as exc:
            raise APIError(502, str(exc)) from None
        return JSONResponse({"status": "success"})

    async def progress(self, name: str) -> AsyncIterator[str]:
        """Each step as one JSON line while the download runs in a thread; a failure is a
        last {"error": ...} line, as Ollama sends it."""
        loop, steps = asyncio.get_running_loop(), asyncio.Queue()
        job = loop.run_in_executor(None, pull, name, lambda p: loop.call_soon_threadsafe(steps.put_nowait, p))
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(steps.put_nowait, None))
        while (step := await steps.get()) is not None:
            yield json.dumps(ollama_line(step)) + "\n"
        if job.exception() is not None:
            yield json.dumps({"error": str(job.exception())}) + "\n"

    async def delete(self, http: HTTPRequest) -> Response:
        name = model_name(DeleteBody.model_validate_json(await http.body()))
        found = await run_in_threadpool(find_local, name)
        if found is None:
            raise APIError(404, f"model '{name}' not found")
        served = await run_in_threadpool(lambda: [m.path.resolve() for m in self.state.models.models if m.path])
        if found.path.resolve() in served:
            raise bad_request(f"model '{name}' is one this server serves: stop the server to delete it", "model")
        await run_in_threadpool(remove, name)
        return Response(status_code=200)
