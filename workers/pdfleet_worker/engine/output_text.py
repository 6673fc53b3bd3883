"""A request's output text as it streams: its detokenizer, the text so far and how much of it was sent; LLMEngine keeps
one on each Sequence (when it has a tokenizer) and the stop strings read it."""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Detokenizer(Protocol):
    """model/tokenizer.py's IncrementalDetokenizer: the text the tokens added since the last call."""

    def step(self, token_ids: list[int]) -> str: ...


@dataclasses.dataclass
class OutputText:
    detokenizer: Detokenizer
    text: str = ""  # the full output text so far (stop strings need all of it)
    emitted: int = 0  # characters of it already streamed

    def take(self, hold: int) -> str:
        """The text not yet streamed, less its last `hold` characters (what could be the start of a stop string)."""
        upto = max(self.emitted, len(self.text) - hold)
        new = self.text[self.emitted : upto]
        self.emitted = upto
        return new
