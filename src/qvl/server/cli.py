"""`qvl serve`: its arguments (a front door the `qvl` subcommand table registers)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from qvl.options import UsageError, add_engine_args, engine_options
from qvl.server.settings import (MB, ConnectionLimits, ImagePolicy, ModelLimits, ServerSettings, byte_size,
                                 keep_alive_s)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # and every other loopback address
DEFAULT_KEEP_ALIVE_S = 300.0  # several models: each stays loaded 5 minutes after its last request, as in Ollama


def register(sub: argparse._SubParsersAction, commands: dict) -> None:
    s, im, cl = ServerSettings(), ImagePolicy(), ConnectionLimits()
    p = sub.add_parser("serve", help="OpenAI- and Ollama-compatible API and web page over one model or several",
                       description="Serve /v1/chat/completions, /v1/responses, Ollama's /api/*, /v1/models, /health, "
                                   "/metrics and a web page at /. Several models (--model repeated, --models DIR) "
                                   "are chosen by each request's `model`, loaded on first use and unloaded when idle.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /api/* and /metrics; repeat for several "
                        "keys, each with caches of its own (default: $QVL_API_KEY, several separated by commas)")
    p.add_argument("--hide-cache-stats", action="store_true",
                   help="answers do not say what came from the caches (qvl.timings.cached empty, reused and "
                        "cached token counts 0)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated names this server may be reached by (Host header; example.com, "
                        "*.example.com) and whose web pages may call the API (Origin). Loopback binds "
                        "always answer localhost and loopback addresses; other binds answer any host "
                        "unless this is given (default: none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip the small request the worker runs once the model is loaded (it saves the first "
                        "real request ~1 s of first-touch costs; requests arriving meanwhile wait for it)")
    g = p.add_argument_group("limits")
    g.add_argument("--queue-size", type=int, default=s.queue_size,
                   help="requests that may wait behind the running one; more get 429 (default: %(default)s)")
    g.add_argument("--max-body-mb", type=float, default=s.max_body_bytes / MB,
                   help="largest request body, also the largest image (default: %(default)g)")
    g.add_argument("--request-timeout", type=float, default=s.time_limit_s,
                   help="seconds a request may take, queueing included (default: %(default)g)")
    g.add_argument("--parse-timeout", type=float, default=s.parse_timeout_s,
                   help="seconds to decode a request's images and videos and tokenize it, before --request-timeout "
                        "starts; then 400 naming the part (default: %(default)g)")
    g.add_argument("--shutdown-timeout", type=float, default=s.shutdown_grace_s,
                   help="on SIGTERM, seconds in-flight requests may still finish (default: %(default)g)")
    g.add_argument("--max-images", type=int, help="images per request (default: the engine's, 8)")
    g.add_argument("--max-videos", type=int, help="videos per request (default: the engine's, 2)")
    g.add_argument("--max-video-mb", type=float, default=im.max_video_bytes / MB,
                   help="largest video fetched from an allowed host or read from --image-dir (default: %(default)g; "
                        "a data: URI is bounded by --max-body-mb)")
    g.add_argument("--max-image-pixels", type=int, default=im.max_pixels,
                   help="largest source image, width x height, checked before decoding (default: %(default)s)")
    g.add_argument("--max-connections", type=int, default=cl.max_connections,
                   help="open connections; past it the longest-idle one without a request is closed, else "
                        "the one sending its body most slowly (408); the new one gets 503 only when all others "
                        "are being answered (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=cl.header_timeout_s,
                   help="seconds a client has to send a complete request head, from connecting or "
                        "from the previous answer; then 408 and closed (default: %(default)g)")
    g.add_argument("--body-timeout", type=float, default=cl.body_timeout_s,
                   help="seconds a client has to send the whole body after the head (default: %(default)g)")
    g.add_argument("--keep-alive-timeout", type=float, default=cl.keep_alive_s,
                   help="seconds an idle connection stays open between requests (default: %(default)g)")
    g.add_argument("--write-timeout", type=float, default=cl.write_timeout_s,
                   help="seconds a client may take none of its answer (the server's send buffer full) before "
                        "it is cut off and its request cancelled (default: %(default)g)")
    p.add_argument("--index", type=Path, metavar="DB",
                   help="search this index (made by qvl index add) at POST /v1/search and on the web page; the "
                        "model is the index's unless --model names the same one (of several --model, one must be "
                        "the index's)")
    p.add_argument("--reranker", metavar="[NAME=]MODEL",
                   help="with --index: serve this reranker (Qwen3-VL-Reranker) too, so that a search may ask "
                        "for its results to be reranked (POST /v1/search with rerank, the web page's checkbox)")
    g = p.add_argument_group("image sources (base64 data: URIs always work)")
    g.add_argument("--image-url-hosts", default="",
                   help="comma-separated hosts whose http(s) image URLs may be fetched: example.com, "
                        "*.example.com, or * for any public host (default: none, fetching off)")
    g.add_argument("--image-url-timeout", type=float, default=im.url_timeout_s,
                   help="seconds for one image fetch, from connecting to the last byte (default: %(default)g)")
    g.add_argument("--image-dir", type=Path, help="allow file: URLs and paths under this folder (default: none)")
    g = p.add_argument_group("Ray Serve: several replicas, routed by content (pip install 'qvl[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: each replica one engine; requests about the same image or "
                        "conversation go to the same replica (see docs/cluster.md)")
    g.add_argument("--ray-address", help="cluster to join (default: $RAY_ADDRESS, else a local one started here)")
    g.add_argument("--replicas", type=int, default=1, help="replicas, each of --threads CPUs (default: %(default)s)")
    g.add_argument("--min-replicas", type=int, help="with --max-replicas: autoscale between the two "
                                                    "(default: 1)")
    g.add_argument("--max-replicas", type=int, help="autoscale up to this many replicas on running rows and "
                                                    "queue depth (default: a fixed --replicas)")
    g = p.add_argument_group("several models (see docs/models.md)")
    g.add_argument("--models", type=Path, dest="models_dir", metavar="DIR",
                   help="serve every checkpoint folder in DIR (a folder holding config.json), each called by its "
                        "folder name; with --model, those too")
    g.add_argument("--keep-alive", metavar="DURATION",
                   help="how long a model stays loaded after its last request: 5m, 1h, 90 (seconds), 0 (unloaded "
                        "at once), -1 (for ever); a request's keep_alive (Ollama's) overrides it (default: for ever "
                        "with one model, 5m with several)")
    g.add_argument("--max-loaded", type=int, metavar="N",
                   help="models loaded at once; loading another first unloads the least recently used idle one "
                        "(default: no limit)")
    g.add_argument("--max-memory", metavar="SIZE",
                   help="what the loaded models may hold together (weights, KV cache, caches), e.g. 12G; loading "
                        "another first unloads the least recently used idle ones until it fits (default: no limit)")
    add_engine_args(p, several_models=True)
    commands["serve"] = cmd_serve


def settings(args: argparse.Namespace) -> ServerSettings:
    if args.image_dir is not None and not args.image_dir.is_dir():
        raise ValueError(f"--image-dir {args.image_dir} is not a folder")
    max_bytes = int(args.max_body_mb * MB)
    hosts = tuple(h.strip().lower() for h in args.image_url_hosts.split(",") if h.strip())
    images = ImagePolicy(max_bytes=max_bytes, max_pixels=args.max_image_pixels, url_hosts=hosts,
                         url_timeout_s=args.image_url_timeout, local_dir=args.image_dir,
                         max_video_bytes=int(args.max_video_mb * MB))
    connections = ConnectionLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                                   body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive_timeout,
                                   write_timeout_s=args.write_timeout)
    keys = tuple(k.strip() for k in args.api_keys or os.environ.get("QVL_API_KEY", "").split(",") if k.strip())
    named = tuple(h.strip().lower().rstrip(".") for h in args.allowed_hosts.split(",") if h.strip())
    if is_loopback(args.host):  # a page on another site must not reach us through DNS rebinding
        allowed: tuple[str, ...] | None = LOOPBACK_HOSTS + named
    else:
        allowed = named or None
    return ServerSettings(queue_size=args.queue_size, max_body_bytes=max_bytes, time_limit_s=args.request_timeout,
                          parse_timeout_s=args.parse_timeout, shutdown_grace_s=args.shutdown_timeout,
                          api_keys=keys, hide_cache_stats=args.hide_cache_stats, images=images, warm_up=args.warm_up,
                          connections=connections, allowed_hosts=allowed, allowed_origins=named,
                          models=model_limits(args, len(served_models(args))))


def model_limits(args: argparse.Namespace, count: int) -> ModelLimits:
    if args.keep_alive is None:
        keep_alive = None if count == 1 else DEFAULT_KEEP_ALIVE_S
    else:
        keep_alive = keep_alive_s(args.keep_alive.strip())
    memory = byte_size(args.max_memory) if args.max_memory is not None else None
    return ModelLimits(keep_alive_s=keep_alive, max_loaded=args.max_loaded, max_memory_bytes=memory)


def served_models(args: argparse.Namespace) -> list[tuple[str | None, str | None]]:
    """(name or None, folder or hub id) of every --model (NAME=MODEL or MODEL) and every
    checkpoint folder in --models DIR; [(None, None)] for neither (the default model)."""
    given = [named(text) for text in args.models or []]
    if args.models_dir is not None:
        if not args.models_dir.is_dir():
            raise ValueError(f"--models {args.models_dir} is not a folder")
        found = sorted(p for p in args.models_dir.iterdir() if (p / "config.json").is_file())
        if not found:
            raise ValueError(f"--models {args.models_dir}: no checkpoint folder (one holding config.json) in it")
        given += [(None, str(p)) for p in found]
    return given or [(None, None)]


def named(text: str) -> tuple[str | None, str]:
    """'fast=./ckpt' -> ('fast', './ckpt'); a path or hub id without NAME= -> (None, text)."""
    name, sep, model = text.partition("=")
    if sep and model and re.fullmatch(r"[\w.:-]+", name):
        return name, model
    return None, text


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from qvl.server.app import create_app
    from qvl.server.registry import ModelSource
    from qvl.server.serve import run

    if not args.ray and (args.ray_address or args.replicas != 1 or args.min_replicas is not None
                         or args.max_replicas is not None):
        raise ValueError("--ray-address, --replicas, --min-replicas and --max-replicas need --ray")
    if args.min_replicas is not None and args.max_replicas is None:
        raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
    config = settings(args)
    models = served_models(args)
    if args.ray and len(models) > 1:
        raise ValueError("--ray serves one model per replica: give one --model")
    options = engine_options(args)
    index = reranker = None
    if args.reranker is not None and args.index is None:
        raise UsageError("--reranker orders the results of --index: give both")
    if args.index is not None:
        if args.ray:
            raise ValueError("--index is served by one process: leave out --ray")
        index = opened_index(args.index)
        models = with_index_model(index, models)
    if args.reranker is not None:
        models, reranker = with_reranker(models, args.reranker)
    if args.max_images is not None:
        options = replace(options, max_images=args.max_images)
    if args.max_videos is not None:
        options = replace(options, max_videos=args.max_videos)
    if not is_loopback(args.host):
        risk = "set --api-key (or $QVL_API_KEY) and put TLS in front" if not config.api_keys else "use TLS in front"
        print(f"qvl serve: warning: listening on {args.host}, not loopback: anyone who can reach port "
              f"{args.port} can use this model; {risk}", file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if args.ray:
        (name, model), = models
        return serve_on_ray(args, config, replace(options, model=model, name=name))
    app = create_app(config, [ModelSource.of(replace(options, model=model), name) for name, model in models], index,
                     reranker)
    return run(app, args.host, args.port, args.log_level)


def with_index_model(index, models: list[tuple[str | None, str | None]]) -> list[tuple[str | None, str | None]]:
    """The models served beside an index: its own model when --model is not given; one
    --model must be it (its vectors would not compare otherwise); of several, one must be."""
    from qvl.retrieval.index_cli import index_model, model_key

    if len(models) == 1:
        (name, model), = models
        return [(name, index_model(index, model))]
    if not any(model and model_key(model) == index.meta["model"] for _, model in models):
        raise UsageError(f"the index {index.folder} holds vectors of {index.meta['model']}, which none of the "
                         "--model is: serve it too")
    return models


def with_reranker(models: list[tuple[str | None, str | None]],
                  text: str) -> tuple[list[tuple[str | None, str | None]], str]:
    """The models served with the reranker --reranker [NAME=]MODEL among them (added last, unless
    a --model is it already), and the name it is served as. A local folder that is not a
    reranker is refused."""
    from qvl.retrieval.index_cli import model_key
    from qvl.retrieval.task import RERANK, model_task
    from qvl.server.registry import served_name

    name, model = named(text)
    if Path(model).expanduser().is_dir() and model_task(Path(model).expanduser(), model) != RERANK:
        raise UsageError(f"--reranker {model} is not a reranker (a Qwen3-VL-Reranker checkpoint)")
    for given_name, given in models:
        if given and model_key(given) == model_key(model):
            return models, given_name or served_name(given)
    return [*models, (name, model)], name or served_name(model)


def opened_index(folder: Path):
    """The index at `folder`, its search graph loading in the background (FAISS checked first)."""
    import threading

    from qvl.retrieval.store import Store, faiss_module

    faiss_module()
    store = Store.open(folder)
    threading.Thread(target=store.graph, name="qvl-index-load", daemon=True).start()
    return store


def serve_on_ray(args: argparse.Namespace, config: ServerSettings, options) -> int:
    """Each replica reserves --threads CPUs; without it, this machine's physical cores shared
    by the most replicas there may be (a cluster of other machines: give --threads)."""
    from qvl.runtime import physical_cores

    try:
        from qvl.server.cluster import Scale, run
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray Serve: pip install 'qvl[ray]'  (or: pip install 'ray[serve]'): {exc}") from None
    most = args.max_replicas or args.replicas
    threads = options.threads or max(1, physical_cores() // most)
    scale = Scale(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas, cpus=threads)
    return run(config, replace(options, threads=threads), scale, host=args.host, port=args.port,
               address=args.ray_address)
