"""Fetching an image from an http(s) URL for the server, bounded in size and time.

Only `ellm serve --allow-image-urls` uses this: it lets every client make the server open
connections (to the internet, and to whatever the server's network reaches), so it is off
by default. The body is streamed and cut off at the size limit; the whole fetch, redirects
included, has one deadline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .images import ImageError


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0          # the whole fetch: connect, redirects, body
    max_redirects: int = 3


def fetch_image(url: str, where: str = "the image", limits: FetchLimits = FetchLimits()) -> bytes:
    """The bytes at an http(s) URL, or an ImageError naming what went wrong."""
    import httpx
    if not url.startswith(("http://", "https://")):
        raise ImageError(f"{where}: only http(s) URLs are fetched, not {url[:40]!r}", param=where)
    deadline = time.monotonic() + limits.timeout_s
    try:
        with httpx.Client(follow_redirects=True, max_redirects=limits.max_redirects,
                          timeout=httpx.Timeout(limits.timeout_s)) as client:
            with client.stream("GET", url, headers={"Accept": "image/*"}) as resp:
                if resp.status_code != 200:
                    raise ImageError(f"{where}: fetching the URL gave HTTP {resp.status_code}", param=where)
                declared = resp.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                    raise ImageError(f"{where}: the URL's image has {declared} bytes; at most "
                                     f"{limits.max_bytes} are accepted", param=where)
                chunks, size = [], 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > limits.max_bytes:
                        raise ImageError(f"{where}: the URL's image has more than {limits.max_bytes} bytes",
                                         param=where)
                    if time.monotonic() > deadline:
                        raise ImageError(f"{where}: fetching the URL took more than {limits.timeout_s:g} s",
                                         param=where)
                    chunks.append(chunk)
    except httpx.TimeoutException:
        raise ImageError(f"{where}: fetching the URL took more than {limits.timeout_s:g} s", param=where) from None
    except httpx.TooManyRedirects:
        raise ImageError(f"{where}: the URL redirects more than {limits.max_redirects} times", param=where) from None
    except httpx.HTTPError as e:
        raise ImageError(f"{where}: the URL could not be fetched ({type(e).__name__}: {e})", param=where) from None
    return b"".join(chunks)
