"""The router's HTTP/1.1 response reader (router/response_reader.py), pure: every framing a worker may use, the bytes
cut at every place a socket may cut them, and malformed answers refused with a reason."""

from __future__ import annotations

import pytest

from pdfleet_worker.router.response_reader import ProtocolError, ResponseReader

EVENTS = [b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" tok"}]}\n\n', b"data: [DONE]\n\n"]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"x-dup: a\r\nx-dup: b\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
)


def read(cuts: list[bytes]) -> tuple[ResponseReader, bytes]:
    reader, body = ResponseReader(), []
    for piece in cuts:
        reader.feed(piece)
        if reader.body:
            body.append(reader.take())
    return reader, b"".join(body)


def test_a_chunked_stream_cut_anywhere_decodes_to_the_same_body():
    whole = b"".join(EVENTS)
    cuttings = [[CHUNKED[:i], CHUNKED[i:]] for i in range(len(CHUNKED) + 1)]
    cuttings.append([CHUNKED[i : i + 1] for i in range(len(CHUNKED))])
    for cuts in cuttings:
        reader, body = read(cuts)
        assert body == whole, cuts
        assert reader.complete and reader.reusable and not reader.extra
        assert reader.head.status == 200 and reader.head.headers["content-type"] == "text/event-stream"
        assert reader.head.headers["x-dup"] == "a, b"


def test_content_length_bodies_end_at_their_length():
    reader, body = read([b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nRetry-After: 1\r\n\r\nbu", b"sy"])
    assert (reader.head.status, body, reader.complete) == (503, b"busy", False)
    reader.feed(b"!")
    assert reader.take() == b"!" and reader.complete and reader.reusable
    empty, body = read([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
    assert empty.complete and body == b""
    no_content, _ = read([b"HTTP/1.1 204 No Content\r\n\r\n"])
    assert no_content.complete and no_content.reusable


def test_a_body_without_length_ends_when_the_worker_closes_and_the_connection_is_spent():
    reader, body = read([b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n", b"data: 2\n\n"])
    assert body == b"data: 1\n\ndata: 2\n\n" and not reader.complete
    reader.eof()
    assert reader.complete and not reader.reusable


def test_what_keeps_a_connection_from_being_reused():
    close, _ = read([b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 0\r\n\r\n"])
    old, _ = read([b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"])
    extra, _ = read([b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nxHTTP/1.1"])
    assert close.complete and old.complete and extra.complete
    assert not close.reusable and not old.reusable and not extra.reusable


def test_interim_answers_chunk_extensions_and_trailers_are_read_past():
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3;name=value\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"
    )
    reader, body = read([raw])
    assert reader.head.status == 200 and body == b"abc" and reader.complete and reader.reusable


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-1\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc", "does not end with CRLF"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
    ],
)
def test_malformed_answers_are_refused_naming_the_fault(raw, why):
    with pytest.raises(ProtocolError, match=why):
        ResponseReader().feed(raw)


def test_an_endless_head_or_size_line_is_refused():
    with pytest.raises(ProtocolError, match="head over"):
        ResponseReader().feed(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (70 << 10))
    with pytest.raises(ProtocolError, match="chunk-size line"):
        ResponseReader().feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"1" * 2000)


def test_the_worker_closing_early_is_an_error_that_says_when():
    before = ResponseReader()
    before.feed(b"HTTP/1.1 2")
    with pytest.raises(ProtocolError, match="without sending a response"):
        before.eof()
    during, _ = read([CHUNKED[:-20]])
    with pytest.raises(ProtocolError, match="without sending complete message body"):
        during.eof()
