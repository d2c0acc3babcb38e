"""Resumable HTTP(S) download of one file with a progress bar (``urllib`` and ``tqdm`` only).

The bytes go to a ``.partial`` file. When it already holds some, the request asks for the rest
(``Range: bytes=N-``): a ``206`` answer is appended, a ``200`` (a server without ranges) starts
over. A transfer that ends before the announced length (or ``expected_size``) raises
:class:`IncompleteDownloadError` and keeps the partial file, so the next call resumes it.
"""

from __future__ import annotations

import http.client
import re
import urllib.error
import urllib.request
from pathlib import Path

from .errors import DownloadError, IncompleteDownloadError

BLOCK = 1 << 20
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


def download(
    url: str,
    dest: str | Path,
    *,
    expected_size: int | None = None,
    progress: bool = True,
    timeout: float = 60.0,
    _restarted: bool = False,
) -> int:
    """Download ``url`` into ``dest``, continuing what ``dest`` already holds; returns its size.

    Raises :class:`IncompleteDownloadError` (``dest`` kept) when the transfer stops early, and
    :class:`DownloadError` when the server refuses or cannot be reached.
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
                progress=progress,
                timeout=timeout,
                _restarted=True,
            )
        raise DownloadError(f"{url}: HTTP {err.code} {err.reason}; check the URL") from err
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", err)
        if have:
            msg = f"{url}: cannot connect ({reason}); {resume_hint}"
            raise IncompleteDownloadError(msg) from err
        msg = f"{url}: cannot download ({reason}); check the URL and the network"
        raise DownloadError(msg) from err

    with response:
        total: int | None
        if response.status == 206:
            start, total = _content_range(response.headers.get("Content-Range"))
            if start != have:
                raise DownloadError(
                    f"{url}: the server resumed at byte {start}, not {have}; delete {dest} and "
                    "pull again"
                )
        else:  # 200: the whole file (a server without ranges): start over
            have = 0
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        if total is None:
            total = expected_size
        if expected_size is not None and total != expected_size:
            raise DownloadError(
                f"{url}: the server offers {total} bytes, the index says {expected_size}; the "
                "file there is not the published artifact"
            )
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
            try:
                for block in iter(lambda: response.read(BLOCK), b""):
                    sink.write(block)
                    have += len(block)
                    bar.update(len(block))
            except (OSError, http.client.HTTPException) as err:  # reset, timeout, bad chunk
                interrupted = err
    if interrupted is not None or (total is not None and have < total):
        why = f" ({interrupted})" if interrupted is not None else ""
        raise IncompleteDownloadError(
            f"{url}: the download stopped at {have} of {total if total is not None else '?'} "
            f"bytes{why}; {resume_hint}"
        ) from interrupted
    return have
