"""Cutting SSE bytes into whole events without parsing them (router/sse_events.py): what a piece completes passes as
it came, a partial event waits, and only pieces that may end a stream are worth splitting."""

from __future__ import annotations

from pdfleet_worker.router import sse_events

STREAM = b': keep-alive\n\ndata: {"text":"a"}\n\ndata: {"text":"data: [DONE]"}\n\ndata: [DONE]\n\n'


def test_every_cut_gives_back_the_same_bytes_as_whole_events():
    for i in range(len(STREAM) + 1):
        cutter = sse_events.EventCutter()
        pieces = [cutter.cut(STREAM[:i]), cutter.cut(STREAM[i:])]
        assert b"".join(pieces) == STREAM and cutter.partial == b""
        assert all(p == b"" or p.endswith(b"\n\n") for p in pieces)
        assert sse_events.split(b"".join(pieces)) == [e + b"\n\n" for e in STREAM.split(b"\n\n")[:-1]]


def test_a_piece_passes_without_a_copy_when_it_ends_on_an_event():
    piece = b'data: {"text":"a"}\n\n'
    assert sse_events.EventCutter().cut(piece) is piece


def test_what_is_looked_into():
    assert not sse_events.has_data(b": keep-alive\n\n: keep-alive\n\n")
    assert sse_events.has_data(b": keep-alive\n\ndata: 1\n\n") and sse_events.has_data(b"data: 1\n\n")
    assert sse_events.may_end(b"data: [DONE]\n\n") and sse_events.may_end(b'data: {"error": {}}\n\n')
    assert not sse_events.may_end(b'data: {"text":"a"}\n\n: keep-alive\n\n')
