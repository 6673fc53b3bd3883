"""One HTTP/1.1 response read from the bytes a worker sends (pure, no I/O): its status and headers, its body decoded
from chunked, Content-Length or close-delimited framing, and whether the connection may carry another request; the
router's stream client (stream_client.py) feeds it from its socket callback. No torch."""

from __future__ import annotations

import dataclasses
import re

MAX_HEAD_BYTES = 64 << 10
MAX_LINE_BYTES = 1024  # a chunk-size line (the size and any extensions)
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
# self._left, between chunks: a chunk's data ends with CRLF, then comes a size line; after the last (0) chunk, trailers.
_CRLF, _SIZE, _TRAILER = -1, -2, -3
# Body framing (RFC 9112 section 6.3).
_CHUNKED, _LENGTH, _CLOSE = "chunked", "length", "close"


class ProtocolError(ValueError):
    """Bytes that are not an HTTP/1.1 response."""


@dataclasses.dataclass(frozen=True)
class Head:
    status: int
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    keep_alive: bool  # HTTP/1.1 and no `Connection: close`


class ResponseReader:
    """feed() the response's bytes as they come; `head` once its head has come, body pieces in `body` (take() them),
    `complete` at the body's end. Interim (1xx) responses are skipped."""

    def __init__(self) -> None:
        self.head: Head | None = None
        self.body: list[bytes] = []
        self.buffered = 0  # bytes in `body`
        self.complete = False
        self.extra = False  # bytes after the response: the connection cannot be reused
        self._raw = b""  # bytes not parsed yet
        self._framing = ""
        self._left = 0  # chunked: data bytes left in this chunk, or _CRLF/_SIZE/_TRAILER; length: bytes left

    def feed(self, data: bytes) -> None:
        """ProtocolError on a malformed response."""
        raw = self._raw + data if self._raw else data
        pos = 0
        if self.head is None:
            pos = self._read_head(raw)
            if self.head is None:
                self._raw = raw[pos:]
                return
        if self.complete:
            self.extra = self.extra or pos < len(raw)
            self._raw = b""
            return
        if self._framing == _CHUNKED:
            pos = self._chunked(raw, pos)
        elif self._framing == _LENGTH:
            end = min(len(raw), pos + self._left)
            self._piece(raw[pos:end] if pos or end < len(raw) else raw)
            self._left -= end - pos
            pos = end
            self.complete = self._left == 0
        else:
            self._piece(raw[pos:] if pos else raw)
            pos = len(raw)
        self.extra = self.complete and pos < len(raw)
        self._raw = b"" if self.complete or pos == len(raw) else raw[pos:]

    def eof(self) -> None:
        """The worker closed the connection: the end of a close-delimited body; ProtocolError if the response was
        not complete."""
        if self.complete:
            return
        if self.head is None:
            raise ProtocolError("Server disconnected without sending a response.")
        if self._framing != _CLOSE:
            raise ProtocolError("peer closed connection without sending complete message body")
        self.complete = True

    def take(self) -> bytes:
        """The body bytes decoded so far and not taken yet."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body, self.buffered = [], 0
        return data

    @property
    def reusable(self) -> bool:
        """The connection is at a clean boundary and the worker keeps it open."""
        return self.complete and not self.extra and self.head is not None and self.head.keep_alive

    # -- the head -----------------------------------------------------------------------------------------
    def _read_head(self, raw: bytes) -> int:
        pos = 0
        while self.head is None:
            end = raw.find(b"\r\n\r\n", pos)
            if end < 0:
                if len(raw) - pos > MAX_HEAD_BYTES:
                    raise ProtocolError(f"a response head over {MAX_HEAD_BYTES} bytes")
                return pos
            head = _parse_head(raw[pos:end])
            pos = end + 4
            if 100 <= head.status < 200:
                if head.status == 101:
                    raise ProtocolError("the worker switched protocols (101)")
                continue  # interim: 100 Continue, 103 Early Hints
            self.head = head
            self._frame(head)
        return pos

    def _frame(self, head: Head) -> None:
        h = head.headers
        coding = h.get("transfer-encoding")
        if head.status in (204, 304):
            self._framing, self._left, self.complete = _LENGTH, 0, True
        elif coding is not None:
            # NOTE: a transfer coding other than chunked last is close-delimited (RFC 9112 6.3, item 4 for responses)
            chunked = coding.rsplit(",", 1)[-1].strip().lower() == "chunked"
            self._framing, self._left = (_CHUNKED, _SIZE) if chunked else (_CLOSE, 0)
        elif "content-length" in h:
            values = {v.strip() for v in h["content-length"].split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise ProtocolError(f"bad Content-Length {h['content-length']!r}")
            self._framing, self._left = _LENGTH, int(values.pop())
            self.complete = self._left == 0
        else:
            self._framing = _CLOSE
        if self._framing == _CLOSE:
            self.head = dataclasses.replace(head, keep_alive=False)

    # -- the body ----------------------------------------------------------------------------------------
    def _piece(self, data: bytes) -> None:
        if data:
            self.body.append(data)
            self.buffered += len(data)

    def _chunked(self, raw: bytes, pos: int) -> int:
        n = len(raw)
        while pos < n:
            left = self._left
            if left > 0:  # inside a chunk's data
                end = min(n, pos + left)
                self._piece(raw[pos:end])
                self._left = left - (end - pos) or _CRLF
                pos = end
            elif left == _CRLF:
                if n - pos < 2:
                    return pos
                if raw[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("a chunk's data does not end with CRLF")
                pos += 2
                self._left = _SIZE
            elif left == _SIZE:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > MAX_LINE_BYTES:
                        raise ProtocolError("a chunk-size line over 1 KiB")
                    return pos
                size = raw[pos:end].split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    raise ProtocolError(f"bad chunk size {size[:20]!r}")
                pos = end + 2
                self._left = int(size, 16) or _TRAILER
            else:  # _TRAILER: trailer fields (ignored) up to an empty line
                if raw.startswith(b"\r\n", pos):
                    self.complete = True
                    return pos + 2
                end = raw.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEAD_BYTES:
                        raise ProtocolError(f"trailers over {MAX_HEAD_BYTES} bytes")
                    return pos
                self.complete = True
                return end + 4
        return pos


def _parse_head(block: bytes) -> Head:
    lines = block.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit() or rest[3:4] not in ("", " "):
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise ProtocolError(f"bad header line {line[:80]!r}")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    keep_alive = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    return Head(int(code), headers, keep_alive)
