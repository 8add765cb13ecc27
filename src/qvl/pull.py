"""`qvl pull`: a model's files into the Hugging Face cache, with progress, resumed after an
interruption, each file checked against the hub's checksum before it is kept.

Through huggingface_hub's own calls (so $HF_HOME, $HF_ENDPOINT, $HF_TOKEN and offline mode
hold): the file list and each file's metadata come from the hub; the bytes go to
`blobs/<etag>.incomplete` in the cache, resumed with a Range request from what is there, and
become `blobs/<etag>` once their SHA-256 (large files) or git blob hash (small ones) matches
the etag; then `snapshot_download` links the snapshot and the branch to them as it always does."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from qvl.hub import MODEL_FILES
from qvl.models import hub_id

REPORT_BYTES = 1 << 20  # progress is reported every this many bytes
ATTEMPTS = 5  # tries per file in a row that bring no new byte


@dataclass(frozen=True)
class Progress:
    """One step of a pull, in the fields Ollama's /api/pull streams."""

    status: str  # pulling manifest | pulling | verifying | writing manifest | success
    file: str | None = None
    digest: str | None = None  # sha256:<hex> (large files) or sha1:<git blob hash>
    total: int | None = None
    completed: int | None = None


Report = Callable[[Progress], None]


class ChecksumError(OSError):
    """A downloaded file's hash is not the one the hub lists: it is deleted, not kept."""


class Quiet(tqdm):
    """snapshot_download's bars, hidden: linking files already fetched says nothing new."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})


def _ignore(_: Progress) -> None:
    pass


def pull(name: str, report: Report = _ignore, revision: str = "main") -> Path:
    """Download `name` (a hub id or a short name) into the Hugging Face cache; returns its
    snapshot folder. Files already there are not fetched again; a partial file is resumed."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import filter_repo_objects

    repo = hub_id(name)
    report(Progress("pulling manifest"))
    try:
        info = HfApi().model_info(repo, revision=revision)
    except OfflineModeIsEnabled:
        return _cached(repo, revision, report)
    except Exception as exc:  # noqa: BLE001 - the hub's errors (not found, gated, no network) end the pull
        raise RuntimeError(f"cannot pull '{repo}': {_reason(exc)}") from None
    files = list(filter_repo_objects([s.rfilename for s in info.siblings or []], allow_patterns=MODEL_FILES))
    if "config.json" not in files:
        raise RuntimeError(f"'{repo}' holds no config.json: not a model qvl can run")
    for file in files:
        _fetch(repo, file, info.sha, report)
    report(Progress("writing manifest"))
    path = Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES, tqdm_class=Quiet))
    report(Progress("success"))
    return path


def _cached(repo: str, revision: str, report: Report) -> Path:
    """Offline: the model as the cache holds it, or an error saying so."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES, local_files_only=True))
    except Exception:  # noqa: BLE001 - not there, or incomplete
        raise RuntimeError(f"cannot pull '{repo}' in offline mode (HF_HUB_OFFLINE is set) and it is not in the "
                           "Hugging Face cache") from None
    report(Progress("success"))
    return path


def _reason(exc: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return "the repository is gated: accept its terms on the hub and log in (hf auth login or HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "no such revision"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such model on the hub (or it is private: log in with hf auth login or HF_TOKEN)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"


def _fetch(repo: str, file: str, commit: str, report: Report) -> None:
    """One file into `blobs/<etag>` of the cache, unless it is there already."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name

    url = hf_hub_url(repo, file, revision=commit)
    meta = get_hf_file_metadata(url)
    if meta.etag is None or meta.size is None:
        raise RuntimeError(f"the hub sent no checksum or size for {file}")
    blob = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "blobs" / meta.etag
    digest = _digest(meta.etag)
    if blob.exists():
        report(Progress("pulling", file, digest, meta.size, meta.size))
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + ".incomplete")
    same_host = urlparse(url).netloc == urlparse(meta.location).netloc
    _download(meta.location, partial, meta.size, same_host, lambda n: report(Progress("pulling", file, digest,
                                                                                        meta.size, n)))
    report(Progress("verifying", file, digest, meta.size, meta.size))
    _verify(partial, meta.etag, file)
    os.replace(partial, blob)


def _digest(etag: str) -> str:
    return f"sha256:{etag}" if len(etag) == 64 else f"sha1:{etag}"


def _download(url: str, partial: Path, size: int, with_token: bool, progress: Callable[[int], None]) -> None:
    """Append the missing bytes of `url` to `partial` until it holds `size` bytes, each piece
    written as it arrives: a dropped connection resumes from what was written, up to ATTEMPTS
    times in a row without a new byte; then the error stands and the next pull resumes."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    headers = build_hf_headers() if with_token else {}
    headers["Accept-Encoding"] = "identity"  # the bytes the checksum covers, ranges that mean what they say
    failures = 0
    with open(partial, "ab") as out:
        reported = out.tell()
        progress(reported)
        while (have := out.tell()) < size:
            try:
                ranged = {**headers, "Range": f"bytes={have}-"} if have else headers
                with http_stream_backoff("GET", url, headers=ranged, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                         retry_on_exceptions=()) as response:
                    hf_raise_for_status(response)
                    if have and response.status_code != 206:  # the server sent it whole: start over
                        out.seek(0)
                        out.truncate()
                    for piece in response.iter_bytes():
                        out.write(piece)
                        out.flush()
                        failures = 0
                        if out.tell() - reported >= REPORT_BYTES:
                            reported = out.tell()
                            progress(reported)
            except httpx2.TransportError:
                failures += 1
                if failures >= ATTEMPTS:
                    raise
                time.sleep(min(failures - 1, 4))  # the first retry at once
        if out.tell() != size:
            raise OSError(f"{partial.name}: got {out.tell()} bytes, the hub lists {size}")
    progress(size)


def _verify(path: Path, etag: str, file: str) -> None:
    """SHA-256 for an etag of 64 hex digits (LFS files), git's blob hash for 40 (small files);
    another kind of etag (a mirror's own) cannot be checked. A mismatch deletes the file."""
    if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", etag):
        return
    h = hashlib.sha256() if len(etag) == 64 else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    if h.hexdigest() != etag:
        path.unlink()
        raise ChecksumError(f"{file}: checksum mismatch (got {h.hexdigest()}, the hub lists {etag}); the file "
                            "was deleted, pull again")
