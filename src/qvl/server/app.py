"""The FastAPI app: routes only. Handlers live in openai.py, responses.py, ollama.py,
embeddings.py, catalog.py and pulls.py, state in state.py (the models in registry.py), the
error shape in errors.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from qvl.engine import Engine
from qvl.retrieval.store import Store
from qvl.server import embeddings, errors, search
from qvl.server.catalog import Catalog
from qvl.server.errors import APIError
from qvl.server.guard import BrowserGuard, matching_key
from qvl.server.metrics import StatusCounter
from qvl.server.ollama import Ollama, version
from qvl.server.openai import ChatCompletions
from qvl.server.pulls import Pulls
from qvl.server.registry import ModelSource
from qvl.server.settings import ServerSettings
from qvl.server.responses import Responses
from qvl.server.state import ServerState
from qvl.server.submit import Submitter
from qvl.tasks import TASKS

STATIC = Path(__file__).parent / "static"


def web_page(max_body_bytes: int, has_index: bool) -> str:
    """index.html with the task presets (so the page and the CLI share one prompt text), the
    body limit (so the page refuses a file too large to send before sending it) and whether
    there is an index to search (its search box) filled in."""
    tasks = [{"name": t.name, "prompt": t.prompt, "greedy": t.greedy, "description": t.description,
              "max_image_tokens": t.max_image_tokens, "subject": t.subject, "grounding": t.grounding}
             for t in TASKS.values()]
    data = json.dumps(tasks, ensure_ascii=False).replace("</", "<\\/")
    page = (STATIC / "index.html").read_text(encoding="utf-8").replace("{{QVL_TASKS}}", data)
    page = page.replace("{{QVL_INDEX}}", json.dumps(has_index))
    return page.replace("{{QVL_MAX_BODY_BYTES}}", str(int(max_body_bytes)))


def wrong_key() -> APIError:
    return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def bearer_auth(keys: tuple[str, ...]) -> Callable:
    async def check(request: Request) -> None:
        if matching_key(request.headers.get("authorization", ""), keys) is None:
            raise wrong_key()

    return check


def create_app(settings: ServerSettings, models: Callable[[], Engine] | Sequence[ModelSource],
               index: Store | None = None, reranker: str | None = None) -> FastAPI:
    """models: what to serve (registry.py), or one function that builds the only engine. Loads
    run in a background thread so /health answers at once. `index`: an index to search with
    its (embedding) model, one of them (/v1/search); `reranker`: the name of one of them, a
    reranker, that orders a search's results when it asks to be reranked."""
    state = ServerState(settings, models)
    submit = Submitter(state)
    chat = ChatCompletions(state, submit)
    responses = Responses(state, submit)
    ollama = Ollama(state, submit)
    catalog = Catalog(state)
    pulls = Pulls(state)
    page = web_page(settings.max_body_bytes, index is not None)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.start()
        yield
        await asyncio.to_thread(state.stop)

    app = FastAPI(title="qvl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.qvl = state
    errors.install(app)
    app.add_middleware(BrowserGuard, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins)
    app.add_middleware(StatusCounter, metrics=state.metrics)  # outermost: counts the guard's refusals too
    api = APIRouter(dependencies=[Depends(bearer_auth(settings.api_keys))] if settings.api_keys else [])

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat(request)

    @api.post("/v1/responses")
    async def create_response(request: Request):
        return await responses(request)

    api.add_api_route("/api/chat", ollama.chat, methods=["POST"])
    api.add_api_route("/api/generate", ollama.generate, methods=["POST"])
    api.add_api_route("/api/show", catalog.show, methods=["POST"])
    api.add_api_route("/api/tags", catalog.tags, methods=["GET"])
    api.add_api_route("/api/ps", catalog.ps, methods=["GET"])
    api.add_api_route("/v1/models", catalog.models, methods=["GET"])
    api.add_api_route("/api/version", version, methods=["GET"])
    embeddings.register(api, state, submit)
    if index is not None:
        search.register(api, state, submit, index, reranker)
    api.add_api_route("/api/pull", pulls.pull, methods=["POST"])
    api.add_api_route("/api/delete", pulls.delete, methods=["DELETE"])

    @api.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.gauges(), state.cache_stats()), media_type="text/plain; version=0.0.4")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    app.include_router(api)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
