"""Per-request state the Sampler keeps between steps: token counts for the penalties (rows of one pooled tensor) and
prompt logprobs scored so far; the Sampler owns them, LLMEngine registers requests."""

from __future__ import annotations

import dataclasses

import torch


class TokenCounts:
    """For each penalized request, one row of two pooled tensors: which tokens its prompt holds ([cap, V]
    bool) and how often each token was sampled ([cap, V] int32). A step gathers its rows with one index;
    sampled tokens are counted with one index_put. Rows are reused once a request is forgotten."""

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}
        self.pending: dict[str, list[int]] = {}  # prompts of requests not sampled yet (the vocabulary is not known)
        self.free: list[int] = []
        self.prompt: torch.Tensor | None = None  # [cap, V] bool
        self.output: torch.Tensor | None = None  # [cap, V] int32

    def __len__(self) -> int:
        return len(self.slot) + len(self.pending)

    def add(self, request_id: str, prompt_ids: list[int]) -> None:
        assert request_id not in self.slot and request_id not in self.pending, f"{request_id} counted twice"
        self.pending[request_id] = list(prompt_ids)

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        slot = self.slot.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def slots(self, request_ids: list[str], vocab: int, device: torch.device) -> torch.Tensor:
        """Row indices of these requests ([P] int64), giving a row to each seen for the first time (an
        unregistered one starts with an empty prompt)."""
        new = [rid for rid in request_ids if rid not in self.slot]
        if new:
            self._place(new, vocab, device)
        return torch.tensor([self.slot[rid] for rid in request_ids], dtype=torch.int64, device=device)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        assert self.output is not None
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def _place(self, request_ids: list[str], vocab: int, device: torch.device) -> None:
        if self.prompt is None or self.prompt.shape[1] != vocab:
            assert not self.slot, "the vocabulary cannot change while requests are counted"
            self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
            self.output = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        while len(self.free) < len(request_ids):
            self._grow()
        rows, cols = [], []
        for rid in request_ids:
            slot = self.free.pop()
            self.slot[rid] = slot
            prompt = [t for t in self.pending.pop(rid, ()) if t < vocab]
            rows += [slot] * len(prompt)
            cols += prompt
        taken = torch.tensor([self.slot[rid] for rid in request_ids], dtype=torch.int64, device=device)
        self.prompt.index_fill_(0, taken, False)
        self.output.index_fill_(0, taken, 0)
        if rows:
            self.prompt[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True

    def _grow(self) -> None:
        cap = self.prompt.shape[0]
        more = max(8, cap)
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(more, self.prompt.shape[1])])
        self.output = torch.cat([self.output, self.output.new_zeros(more, self.output.shape[1])])
        self.free += range(cap + more - 1, cap - 1, -1)


@dataclasses.dataclass
class PromptScore:
    """One request's prompt logprobs: entry p is the logprob of prompt token p given the tokens before it
    (entry 0 is None: nothing predicts the first token)."""

    prompt: list[int]
    top_n: int
    scored: int = 0  # positions whose next-token logprob is in `entries` (position p predicts token p + 1)
    entries: list = dataclasses.field(default_factory=lambda: [None])

    @property
    def done(self) -> bool:
        return self.scored >= len(self.prompt) - 1
