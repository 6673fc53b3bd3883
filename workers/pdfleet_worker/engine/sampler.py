"""Picks next tokens from logits (greedy, temperature, top-k, top-p, per-request seeds, logprobs); ModelRunner calls it."""
from __future__ import annotations

import dataclasses

import torch

from pdfleet_worker.engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Rows are independent: each row has its own params and, if seeded, its own generator."""

    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(seed)
            self.generators[request_id] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[SampledToken]:
        # logits: [S, V] fp32, one row per sequence that samples this step
        assert logits.shape[0] == len(params) == len(request_ids), "one logits row per sampling request"
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = self._sample(logits, request_ids, params, greedy)
        return [SampledToken(t, self._logprobs(logits[i], t, params[i].logprobs) if params[i].logprobs is not None else None)
                for i, t in enumerate(tokens)]

    def _sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                greedy: list[bool]) -> list[int]:
        argmax = logits.argmax(-1).tolist()
        tokens = list(argmax)
        for i, p in enumerate(params):
            if greedy[i]:
                continue
            row = logits[i] / p.temperature  # [V]
            if p.top_k and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_row, order = torch.sort(row, descending=True)
                cum = sorted_row.softmax(-1).cumsum(-1)
                # keep the smallest prefix whose mass reaches top_p (always at least one token)
                drop = (cum - sorted_row.softmax(-1)) >= p.top_p
                row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            probs = row.softmax(-1)
            # Gumbel-style race: argmax(p / E) with E ~ Exp(1) samples from p.
            noise = torch.empty_like(probs)
            if p.seed is not None:
                noise.exponential_(generator=self._generator(request_ids[i], p.seed, logits.device))
            else:
                noise.exponential_()
            tokens[i] = int((probs / noise).argmax())
        return tokens

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
        lp = torch.log_softmax(row, -1)  # [V]
        top: list[tuple[int, float]] = []
        if n:
            vals, idx = torch.topk(lp, n)
            top = list(zip(idx.tolist(), vals.tolist()))
        return TokenLogprobs(token, float(lp[token]), top)
