"""Search over an index (`qvl serve --index my.index`): POST /v1/search embeds the query on
the worker as /v1/embeddings does and answers the nearest entries, or, with `rerank` on a
server with a reranker (`--reranker`), the nearest candidates scored against the query by the
reranker's worker, most relevant first; GET /v1/index says what the index holds; GET
/v1/index/thumbnail draws an indexed image, PDF page or clip's first frame, small. Thumbnails
are drawn only from files the index holds, inside the folders it was made from (a path that
leaves them, by `..` or a symbolic link, is refused)."""

from __future__ import annotations

import asyncio
import io
import os
from functools import partial
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import Field

from qvl.deadline import Deadline
from qvl.engine import Engine
from qvl.requests import RequestError
from qvl.retrieval.encode import embedding, parse_embedding, parse_pair, relevance, score_vector
from qvl.retrieval.index import dimensions_of, parts_of
from qvl.retrieval.index_cli import model_key
from qvl.retrieval.store import Hit, Store
from qvl.retrieval.task import EMBED, RERANK
from qvl.server.embeddings import Retrieval, parsed_as, prompt_tokens, require_task
from qvl.server.errors import APIError
from qvl.server.schemas import CacheSalt, _Strict
from qvl.server.state import ServerState
from qvl.server.submit import Submitter

MAX_K = 100
CANDIDATES_PER_RESULT = 3  # rerank: the nearest k x this are scored, unless `candidates` says
THUMBNAIL_SIDE = 256  # pixels of a thumbnail's longer side (at most)


class SearchRequest(_Strict):
    query: Any  # a string, content parts, or {"text", "image"} as /v1/embeddings takes an input
    k: int = Field(10, ge=1, le=MAX_K)
    instruction: str | None = Field(None, max_length=4096)  # default: the index's query instruction
    rerank: bool = False  # score the nearest candidates with the server's reranker, best first
    candidates: int | None = Field(None, ge=1, le=CANDIDATES_PER_RESULT * MAX_K)  # with rerank; default 3 x k
    cache_salt: CacheSalt = None


class Search(Retrieval):
    def __init__(self, state: ServerState, submit: Submitter, store: Store, reranker: str | None = None):
        super().__init__(state, submit)
        self.store, self.reranker = store, reranker  # the served reranker's name, if any
        # the served model that made the index's vectors (a server of one serves only it)
        self.model = next((m.name for m in state.models.models if m.source.options and m.source.options.model
                           and model_key(m.source.options.model) == store.meta["model"]), None)

    def model_for(self, req: SearchRequest) -> str | None:
        return self.model

    async def search(self, http: HTTPRequest) -> JSONResponse:
        req, key = await self._read(http, SearchRequest)
        req, dones, engine = await self._answer(http, req, self.model, key, self._prepare_search)
        vector = embedding(dones[0].hidden, dimensions_of(self.store, engine)).numpy()
        wanted = max(req.k, req.candidates or CANDIDATES_PER_RESULT * req.k) if req.rerank else req.k
        hits = await asyncio.to_thread(self.store.search, vector, wanted)
        results = [{**h.to_dict(), "thumbnail": thumbnail_url(h.path, h.page)} for h in hits]
        tokens = prompt_tokens(dones)
        if req.rerank and hits:
            _, scored, reranker = await self._answer(http, req, self.reranker, key,
                                                     partial(self._prepare_pairs, hits), media=True)
            vector = score_vector(reranker)
            results = sorted(({**r, "rerank_score": relevance(d.hidden, vector)} for r, d in zip(results, scored)),
                             key=lambda r: -r["rerank_score"])
            tokens += prompt_tokens(scored)
        return JSONResponse({"object": "list", "model": engine.model_name, "results": results[: req.k],
                             "usage": {"prompt_tokens": tokens}})

    def _prepare_search(self, req: SearchRequest, engine: Engine, deadline: Deadline, salt: str):
        if req.rerank and self.reranker is None:
            raise RequestError("this server has no reranker: start it with --reranker MODEL (a Qwen3-VL-Reranker) "
                               "beside --index", "rerank")
        require_task(engine, EMBED)
        parts = self._parts(req.query, "query", engine)
        instruction = req.instruction or self.store.meta.get("query_instruction")
        return req, [parsed_as("query", lambda: parse_embedding(engine, parts, instruction, deadline, salt))]

    def _prepare_pairs(self, hits: list[Hit], req: SearchRequest, engine: Engine, deadline: Deadline, salt: str):
        """The (query, entry) pairs of the hits for the reranker (the entries read from their files)."""
        require_task(engine, RERANK)
        query = self._parts(req.query, "query", engine)
        return None, [parse_pair(engine, query, parts_of(h.path, h.kind, h.page), None, deadline, salt) for h in hits]

    async def info(self) -> dict:
        counts = await asyncio.to_thread(self.store.counts)
        return {"model": self.store.meta["model"], "dimensions": self.store.dims, "reranker": self.reranker,
                **counts}

    async def thumbnail(self, path: str = Query(...), page: int | None = Query(None, ge=1)) -> Response:
        row = await asyncio.to_thread(self.indexed, path)
        if row.kind == "pdf" and (page is None or page > row.pages):
            raise APIError(400, f"page must be one of the PDF's pages, 1 to {row.pages}", "page")
        try:
            data = await asyncio.to_thread(drawn, row.path, row.kind, page)
        except (OSError, ValueError) as exc:  # gone or damaged since it was indexed
            raise APIError(404, f"{path} cannot be drawn now: {exc}", "path") from None
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=300"})

    def indexed(self, path: str):
        """The index's row of `path`: 403 for a path outside the indexed folders, 404 for one
        inside them that the index does not hold."""
        real = os.path.realpath(path)
        roots = [os.path.realpath(r) for r in self.store.roots()]
        if not os.path.isabs(path) or not any(real == r or real.startswith(r + os.sep) for r in roots):
            raise APIError(403, "the path is outside the indexed folders", "path")
        row = self.store.file(os.path.abspath(path))
        if row is None:
            raise APIError(404, "the index holds no such file", "path")
        return row


def thumbnail_url(path: str, page: int | None) -> str:
    return "/v1/index/thumbnail?" + urlencode({"path": path, **({"page": page} if page is not None else {})})


def drawn(path: str, kind: str, page: int | None) -> bytes:
    """A JPEG of the file (a PDF's page, a clip's first frame), its longer side at most THUMBNAIL_SIDE."""
    if kind == "pdf":
        from qvl.processing.pdf import render_pages

        picture = render_pages(path, str(page), max_pixels=4 * THUMBNAIL_SIDE**2)[0]
    elif kind == "video":
        import av

        try:
            with av.open(path) as container:
                picture = next(container.decode(video=0)).to_image()
        except (av.FFmpegError, StopIteration) as exc:
            raise ValueError(f"no frame of the clip could be decoded ({exc or 'no video frames'})") from None
    else:
        from qvl.processing.image import load_image

        picture = load_image(path)
    picture.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    picture.convert("RGB").save(out, "JPEG", quality=85)
    return out.getvalue()


def register(api: APIRouter, state: ServerState, submit: Submitter, store: Store, reranker: str | None = None) -> None:
    """The search routes on the API router; `reranker`: the name of a served reranker that
    searches may ask to order the results."""
    routes = Search(state, submit, store, reranker)
    api.add_api_route("/v1/search", routes.search, methods=["POST"])
    api.add_api_route("/v1/index", routes.info, methods=["GET"])
    api.add_api_route("/v1/index/thumbnail", routes.thumbnail, methods=["GET"])
