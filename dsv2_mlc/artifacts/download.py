"""Bounded, resumable HTTP(S) download of one file with a progress bar (``urllib``, ``tqdm``).

The bytes go to a ``.partial`` file, and never more of them than the download's **declared
size**: ``expected_size`` (the index entry's ``size``), else the server's ``Content-Length`` (or
``Content-Range`` total), else :data:`MAX_UNDECLARED` (``max_size``). A server that sends more is
cut off at that size and the file deleted. Before writing, the free space of the disk is checked
against the declared size.

Resuming: when the partial file holds some bytes, the request asks for the rest (``Range: bytes=
N-``): a ``206`` answer is appended, a ``200`` (a server without ranges) starts over. A partial
file is kept only when it can be resumed - its declared size is known and the transfer stopped
early (the connection broke: :class:`IncompleteDownloadError`, or Ctrl-C: ``KeyboardInterrupt``);
running the same command again continues it. Any other failure (a download without a declared
size, too many bytes, a write error such as a full disk, a refused request) deletes it.
"""

from __future__ import annotations

import http.client
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from .errors import DownloadError, IncompleteDownloadError

BLOCK = 1 << 20
MAX_UNDECLARED = 32 << 30  # bytes: the cap when neither the index nor the server gives a size
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+|\*)-?(\d*)/(\d+|\*)")


def _user_agent() -> str:
    from ..version import __version__

    return f"dsv2-mlc/{__version__}"


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of a ``Content-Range`` header."""
    m = _CONTENT_RANGE.match(value or "")
    if not m:
        return None, None
    start = None if m.group(1) == "*" else int(m.group(1))
    total = None if m.group(3) == "*" else int(m.group(3))
    return start, total


def _human(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n} bytes"


def download(
    url: str,
    dest: str | Path,
    *,
    expected_size: int | None = None,
    max_size: int | None = None,
    progress: bool = True,
    timeout: float = 60.0,
    _restarted: bool = False,
) -> int:
    """Download ``url`` into ``dest``, continuing what ``dest`` already holds; returns its size.

    At most ``expected_size`` bytes, else the size the server announces, else ``max_size``
    (default :data:`MAX_UNDECLARED`).
    Raises :class:`IncompleteDownloadError` (``dest`` kept, to be resumed) when the transfer
    stops early, and :class:`DownloadError` (``dest`` deleted) when the server refuses, cannot
    be reached, sends more than the declared size, or ``dest`` cannot be written.
    """
    dest = Path(dest)
    have = dest.stat().st_size if dest.is_file() else 0
    if expected_size is not None and have > expected_size:  # not the file we want: start over
        dest.unlink()
        have = 0
    if expected_size is not None and have == expected_size:
        return have
    headers = {"User-Agent": _user_agent()}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    resume_hint = f"run the same command again to resume (the partial download is kept in {dest})"
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and have and not _restarted:  # asked past the end
            _, total = _content_range(err.headers.get("Content-Range"))
            if total == have:
                return have
            dest.unlink()
            return download(
                url,
                dest,
                expected_size=expected_size,
                max_size=max_size,
                progress=progress,
                timeout=timeout,
                _restarted=True,
            )
        if err.code >= 500 and have:  # the server's trouble: keep what we have
            msg = f"{url}: HTTP {err.code} {err.reason}; {resume_hint}"
            raise IncompleteDownloadError(msg) from err
        dest.unlink(missing_ok=True)
        raise DownloadError(f"{url}: HTTP {err.code} {err.reason}; check the URL") from err
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        reason = getattr(err, "reason", err)
        if have:  # kept from a download of known size: bounded, resumable
            msg = f"{url}: cannot connect ({reason}); {resume_hint}"
            raise IncompleteDownloadError(msg) from err
        dest.unlink(missing_ok=True)
        msg = f"{url}: cannot download ({reason}); check the URL and the network"
        raise DownloadError(msg) from err

    keep = False  # whether a failure leaves dest for a resume (only with a declared size)
    try:
        with response:
            total, have = _announced(response, url, have, expected_size)
            limit = total if total is not None else (max_size or MAX_UNDECLARED)
            _check_space(dest, limit - have, url, declared=total is not None)
            keep = total is not None
            return _copy(response, url, dest, have, total, limit, progress, resume_hint)
    except IncompleteDownloadError:
        if not keep:
            dest.unlink(missing_ok=True)
        raise
    except KeyboardInterrupt as err:
        if keep and dest.is_file() and dest.stat().st_size:
            err.add_note(f"the partial download is kept in {dest}; {resume_hint.split(' (')[0]}")
        else:
            dest.unlink(missing_ok=True)
        raise
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def _announced(
    response: http.client.HTTPResponse,
    url: str,
    have: int,
    expected_size: int | None,
) -> tuple[int | None, int]:
    """(the file's total size if declared, the bytes of ``dest`` to keep) for this response."""
    total: int | None
    if response.status == 206:
        start, total = _content_range(response.headers.get("Content-Range"))
        if start != have:
            raise DownloadError(
                f"{url}: the server resumed at byte {start}, not {have}; pull again"
            )
    else:  # 200: the whole file (a server without ranges): start over
        have = 0
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
    if expected_size is not None and total is not None and total != expected_size:
        raise DownloadError(
            f"{url}: the server offers {total} bytes, the index says {expected_size}; the "
            "file there is not the published artifact"
        )
    return (expected_size if total is None else total), have


def _check_space(dest: Path, need: int, url: str, *, declared: bool) -> None:
    """Refuse a declared download that cannot fit on the disk (before writing any of it)."""
    if not declared:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if need > free:
        raise DownloadError(
            f"{url}: {_human(need)} to download and {_human(free)} free in {dest.parent}; free "
            "some space, or pull into another cache with --cache-dir (or DSV2_MLC_CACHE_DIR)"
        )


def _copy(
    response: http.client.HTTPResponse,
    url: str,
    dest: Path,
    have: int,
    total: int | None,
    limit: int,
    progress: bool,
    resume_hint: str,
) -> int:
    """Append the response body to ``dest`` (at most ``limit`` bytes in all); returns its size."""
    from tqdm import tqdm

    interrupted: BaseException | None = None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(dest, "ab" if have else "wb") as sink,
        tqdm(
            total=total,
            initial=have,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=Path(url.split("?")[0]).name or "download",
            disable=not progress,
            leave=False,
        ) as bar,
    ):
        while True:
            try:  # one byte past the limit, to see whether the server sends too much
                block = response.read(min(BLOCK, limit - have + 1))
            except (OSError, http.client.HTTPException) as err:  # reset, timeout, bad chunk
                interrupted = err
                break
            if not block:
                break
            if have + len(block) > limit:
                what = "its declared size" if total is not None else "the cap on downloads"
                raise DownloadError(
                    f"{url}: the server sent more than {_human(limit)} ({what}); this is not an "
                    "artifact (the partial download was deleted)"
                    + ("" if total is not None else "; pull it by name from an index with its size")
                )
            try:
                sink.write(block)
            except OSError as err:  # a full disk, a quota: resuming cannot help
                raise DownloadError(
                    f"cannot write {dest} ({err}); free some space, or pull into another cache "
                    "with --cache-dir (or DSV2_MLC_CACHE_DIR)"
                ) from err
            have += len(block)
            bar.update(len(block))
    if interrupted is not None or (total is not None and have < total):
        why = f" ({interrupted})" if interrupted is not None else ""
        if total is None:
            raise DownloadError(
                f"{url}: the download broke off after {have} bytes{why}, and the server does not "
                "say how large the file is, so it cannot be resumed (deleted); pull again"
            ) from interrupted
        raise IncompleteDownloadError(
            f"{url}: the download stopped at {have} of {total} bytes{why}; {resume_hint}"
        ) from interrupted
    return have
