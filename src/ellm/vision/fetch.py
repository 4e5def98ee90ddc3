"""Fetching an image from an http(s) URL for the server, bounded in size and time, and
never into the server's own network.

Only `ellm serve --allow-image-urls` uses this: it lets every client make the server open
connections, so it is off by default, and when on:
- the address policy: the host is resolved once, every address it resolves to must be
  public (loopback, link-local, private, shared, multicast and reserved ranges are
  refused, IPv4-mapped IPv6 included), and the connection goes to the address that was
  checked, not to a second lookup (so a name that answers differently the second time,
  DNS rebinding, gets nowhere). A host named in `FetchLimits.allowed_hosts`
  (`--allow-image-host NAME`) skips the range check: the way to reach a local image host.
  Every redirect hop is checked the same way;
- nothing of a response that is not an image is repeated to the client: not its status,
  not its bytes, not the connection error (that would make the server a port scanner and a
  reader of other services' first bytes). The error says only that no image came back;
- the body is streamed and cut off at the size limit; the whole fetch, redirects
  included, has one deadline;
- fetches run in their own small thread pool (ImageFetcher), never in the threads that
  tokenize, so a slow URL costs its own request time and nobody else's.
"""
from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .images import ImageError


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0          # the whole fetch: resolve, connect, redirects, body
    max_redirects: int = 3
    # hosts fetched whatever their address (names as written in the URL, compared
    # case-insensitively; an IP literal is its own name)
    allowed_hosts: tuple[str, ...] = ()


# Image signatures: a fetched body must start with one (the decoder then checks it all).
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def _looks_like_image(head: bytes) -> bool:
    return head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def address_is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an address is one a server may be sent to by a client: not loopback,
    link-local, private (10/8, 172.16/12, 192.168/16, fc00::/7), shared (100.64/10),
    multicast, unspecified or reserved; IPv4 inside IPv6 (::ffff:a.b.c.d, 64:ff9b::/96
    NAT64, 6to4) judged by its IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in ipaddress.IPv6Network("64:ff9b::/96"):
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return address_is_public(inner)
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_private or ip.is_unspecified)


class _Refused(Exception):
    """The fetch stops; the message is safe to show the client."""


def _resolve(host: str, port: int, allowed: bool, deadline: float) -> list[str]:
    """The addresses to connect to, each checked against the policy (unless allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise _Refused("the URL's host name does not resolve") from None
    if time.monotonic() > deadline:
        raise TimeoutError
    addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))   # (an IP address: str)
    if not allowed:
        for a in addrs:
            if not address_is_public(ipaddress.ip_address(a.split("%")[0])):
                raise _Refused("the URL's host is not a public internet address (loopback, private, link-local "
                               "and reserved addresses are refused; the server's operator can allow a host by "
                               "name with --allow-image-host)")
    if not addrs:
        raise _Refused("the URL's host name does not resolve")
    return addrs


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an address already checked (the Host header keeps the name)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address already checked; the certificate is checked against the name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def _get(url: str, limits: FetchLimits, deadline: float,
         current: list[http.client.HTTPConnection]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """One GET (no redirect followed), to a checked address; the connection is put in
    `current` (for the deadline's watchdog)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Refused("only http(s) URLs with a host are fetched")
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise _Refused("the URL's port is not a number in 1-65535") from None
    allowed = host.lower() in {h.lower() for h in limits.allowed_hosts}
    addrs = _resolve(host, port, allowed, deadline)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    cls = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
    last: Exception | None = None
    for address in addrs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn = cls(host, port, address, timeout=remaining)
        current[:] = [conn]
        try:
            conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "ellm",
                                                 "Accept-Encoding": "identity"})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise TimeoutError from None
            last = e
    raise _Refused("no image came back from the URL") from last


def _read_body(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, limits: FetchLimits,
               deadline: float, where: str) -> bytes:
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limits.max_bytes:
        raise ImageError(f"{where}: the URL's image has {declared.strip()} bytes; at most "
                         f"{limits.max_bytes} are accepted", param=where)
    chunks, size = [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if conn.sock is not None:
            conn.sock.settimeout(remaining)
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limits.max_bytes:
            raise ImageError(f"{where}: the URL's image has more than {limits.max_bytes} bytes", param=where)
        chunks.append(chunk)
        if len(chunks) == 1 and len(chunk) >= 12 and not _looks_like_image(chunk):
            raise _Refused("no image came back from the URL")
    data = b"".join(chunks)
    if not _looks_like_image(data[:16]):
        raise _Refused("no image came back from the URL")
    return data


def fetch_image(url: str, where: str = "the image", limits: FetchLimits = FetchLimits()) -> bytes:
    """The bytes of the image at an http(s) URL, or an ImageError naming what went wrong in
    words that reveal nothing of what answered (see the module docstring)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ImageError(f"{where}: only http(s) URLs are fetched, not {str(url)[:40]!r}", param=where)
    deadline = time.monotonic() + limits.timeout_s
    # A server that trickles a byte just inside each read's timeout would outlive the
    # deadline: at the deadline the open connection is shut, which ends any read.
    current: list[http.client.HTTPConnection] = []
    watchdog = threading.Timer(limits.timeout_s, _shut, (current,))
    watchdog.daemon = True
    watchdog.start()
    try:
        for _ in range(limits.max_redirects + 1):
            conn, resp = _get(url, limits, deadline, current)
            try:
                if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                    url = urllib.parse.urljoin(url, resp.getheader("Location", ""))
                    continue
                ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
                if resp.status != 200 or (ctype and not ctype.startswith("image/")
                                          and ctype != "application/octet-stream"):
                    raise _Refused("no image came back from the URL")
                return _read_body(conn, resp, limits, deadline, where)
            finally:
                conn.close()
        raise ImageError(f"{where}: the URL redirects more than {limits.max_redirects} times", param=where)
    except _Refused as e:
        raise ImageError(f"{where}: {e}", param=where) from None
    except (TimeoutError, socket.timeout):
        raise ImageError(f"{where}: fetching the URL took more than {limits.timeout_s:g} s", param=where) from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        if time.monotonic() >= deadline:
            raise ImageError(f"{where}: fetching the URL took more than {limits.timeout_s:g} s",
                             param=where) from None
        raise ImageError(f"{where}: no image came back from the URL", param=where) from None
    finally:
        watchdog.cancel()


def _shut(current: list[http.client.HTTPConnection]) -> None:
    for conn in current:
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def image_urls(messages: Iterable[Any]) -> list[str]:
    """The http(s) image URLs in chat messages' content parts, in order, each once."""
    from .chat import IMAGE_PART_TYPES, image_source
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                try:
                    source = image_source(part, "")
                except ImageError:
                    continue
                if isinstance(source, str) and source.startswith(("http://", "https://")):
                    urls.append(source)
    return list(dict.fromkeys(urls))


class ImageFetcher:
    """The server's image fetches: their own thread pool (max_concurrent at a time, never
    the tokenizer threads), each fetch bounded by FetchLimits; fetch_all gathers a
    request's URLs before its prompt is built."""

    def __init__(self, limits: FetchLimits = FetchLimits(), max_concurrent: int = 8) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="ellm-image-fetch")

    async def fetch_all(self, messages: Iterable[Any]) -> dict[str, bytes | ImageError]:
        """url -> its bytes, or the ImageError its fetch ended with (raised later, where
        the URL's place in the messages is known)."""
        urls = image_urls(messages)
        if not urls:
            return {}
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(self._pool, self._one, u) for u in urls))
        return dict(zip(urls, results))

    def _one(self, url: str) -> bytes | ImageError:
        try:
            return fetch_image(url, "the image", self.limits)
        except ImageError as e:
            return e

    @staticmethod
    def lookup(fetched: dict[str, bytes | ImageError]) -> Any:
        """A fetch(url, where) for prepare_messages that answers from fetch_all's results."""
        def fetch(url: str, where: str) -> bytes:
            got = fetched.get(url)
            if isinstance(got, bytes):
                return got
            reason = str(got).split(": ", 1)[-1] if got is not None else "it was not fetched"
            raise ImageError(f"{where}: {reason}", param=where)
        return fetch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
