"""Whole SSE events out of a worker's stream without parsing them (pure): a read's complete events pass on as one
piece, bytes untouched, and only pieces that may hold [DONE] or an error event are split; the proxy's relay and the
routing target's relay use it. No torch.

NOTE: why a substring test is enough: inside a `data:` line JSON escapes every newline, so `\\n\\ndata: [DONE]` (or an
error object's start) begins a new event and can occur nowhere else; a piece starts at an event's start. A token whose
text holds those bytes only makes its piece take the slow path, where events are compared one by one.
"""

from __future__ import annotations

DONE = b"data: [DONE]"
ERROR = b'data: {"error"'
END = b"\n\n"  # NOTE: what vLLM's and pdfleet's workers end an event with (they write no CR)


class EventCutter:
    """Bytes in, whole events out; the start of an event whose end has not come waits for it."""

    def __init__(self) -> None:
        self.partial = b""

    def cut(self, data: bytes) -> bytes:
        """The events `data` completes, as one piece (b'' if none)."""
        if self.partial:
            data = self.partial + data
        end = data.rfind(END) + 2
        if end == 1:
            self.partial = data
            return b""
        self.partial = data[end:]
        return data[:end] if self.partial else data


def may_end(piece: bytes) -> bool:
    """Whether whole events may hold [DONE] or an error event (split() them to know)."""
    return DONE in piece or ERROR in piece


def split(piece: bytes) -> list[bytes]:
    """Whole events, each with its blank line."""
    return [event + END for event in piece.split(END)[:-1]]


def has_data(piece: bytes) -> bool:
    """Whether whole events hold one that is not a comment (a heartbeat)."""
    return not piece.startswith(b":") or any(event and not event.startswith(b":") for event in piece.split(END))
