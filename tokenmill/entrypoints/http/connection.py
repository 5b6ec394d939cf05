"""The HTTP connection every listening port serves (API, health, metrics and dashboard):
uvicorn's httptools protocol with the request head bounded while it arrives.

uvicorn's httptools parser has no limit of its own on a request head: a client may send
megabytes of one header, or a byte of it every few seconds, and the parser holds it all until
the connection closes (eight unfinished 32 MiB headers once cost the process 350 MiB). The
ASGI middleware (request_body.py) sees headers only once they are complete, so the bound is
kept here, at the connection: a head larger than MAX_HEAD_BYTES is answered 431 and the
connection closed; a head not complete HEAD_TIMEOUT_S after its first byte (or after the
connection opened) is answered 408. Bytes are counted a received chunk at a time, so the
bound is MAX_HEAD_BYTES plus at most one chunk."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenmill.entrypoints.http.request_body import MAX_HEADER_BYTES, error_json

# The request line and the headers: the middleware's 16 KiB of header names and values, and
# room for the request line and the separators.
MAX_HEAD_BYTES = MAX_HEADER_BYTES + 8 * 1024
HEAD_TIMEOUT_S = 30.0


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the head's bytes and time bounded (the module's docstring)."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._head_timer = True, 0, None
        self._events = 0  # heads and messages completed on this connection
        self._arm_head_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._arm_head_timer()
        events_before = self._events
        super().data_received(data)
        # Counted only when no head and no message completed in this chunk (it may hold a
        # whole request, or a body's end); a next head begun in it counts from the next one.
        if self._in_head and self._events == events_before \
                and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"The request head is larger than {MAX_HEAD_BYTES // 1024} "
                             "KiB.")

    # parser callbacks (called from inside data_received)
    def on_headers_complete(self) -> None:
        self._in_head, self._events = False, self._events + 1
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0  # the next head; its timer starts with data
        self._events += 1
        super().on_message_complete()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits while the answer streams
            return
        self._refuse(408, "The request head took too long to arrive.")

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_head_timer()
        # (in its route family's shape, where the request line has come: Triton's under /v2/)
        path = (getattr(self, "url", None) or b"").decode("latin-1").split("?", 1)[0]
        body = error_json(message, status, path)
        self.transport.write(b"".join([
            b"HTTP/1.1 %d %s\r\n" % (status, {408: b"Request Timeout",
                                              431: b"Request Header Fields Too Large"}[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()
