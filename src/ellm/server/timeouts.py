"""A deadline for a request's headers, which uvicorn does not have.

uvicorn closes idle keep-alive connections, but a client that connects and then sends its
request line and headers a byte at a time (or nothing at all) holds the connection, and a
slot of the server, for as long as it likes. This H11 protocol gives every request
`seconds` from its first byte (or from the connection, or the end of the previous
response) to complete its headers, then closes the connection. Body reads and response
writes are bounded in the app itself (server/app.py's _Guard).
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ellm.server")


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.run(http=...)) that drops connections whose request
    headers take longer than `seconds` to arrive."""
    if not seconds > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {seconds!r}")

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout = float(seconds)
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_cycle: object = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._waiting_cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers are due (keep-alive may close sooner)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_cycle = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.warning("%s: request headers not complete after %g s; connection closed",
                            self.client, self.header_timeout)
                self.transport.close()

    return HeaderTimeoutProtocol
