"""Picks next tokens from logits for a whole batch with tensor ops: logits processors, the structured output's token
mask, temperature/top-k/top-p/min-p, seeded or unseeded sampling, logprobs and prompt logprobs; ModelRunner calls it,
LLMEngine registers each request's state with add()."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from pdfleet_worker.layers import logits_processors as lp
from pdfleet_worker.layers.sampling_state import PromptScore, TokenCounts
from pdfleet_worker.sampling_params import SamplingParams

PROMPT_ROWS_PER_PASS = 256  # prompt positions turned into logits at once (each row is one [V] fp32 vector)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The token's log-probability under the model, and the top-n alternatives; rank (1 = most likely)
    where it was asked for (prompt logprobs)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclasses.dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Rows are independent: each has its own params, state and, if seeded, its own random stream."""

    def __init__(self) -> None:
        self.eos_token_ids: tuple[int, ...] = ()  # blocked until min_tokens (LLMEngine sets them)
        self.counts = TokenCounts()
        self.grammars: dict[str, Any] = {}  # request id -> llguidance LLMatcher
        self.prompts: dict[str, PromptScore] = {}  # request id -> prompt logprobs being scored
        self._executor = None

    # -- per-request state ------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, matcher: Any = None) -> None:
        """Register what a request's later steps need: its prompt (penalties, prompt logprobs) and its grammar."""
        if params.penalized:
            self.counts.add(request_id, prompt_ids)
        if matcher is not None:
            self.grammars[request_id] = matcher
        if params.prompt_logprobs is not None:
            self.prompts[request_id] = PromptScore(list(prompt_ids), params.prompt_logprobs)

    def forget(self, request_id: str) -> None:
        self.counts.forget(request_id)
        self.grammars.pop(request_id, None)
        self.prompts.pop(request_id, None)

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs | None] | None:
        """Once every prompt position is scored: the entries (and the state is dropped)."""
        score = self.prompts.get(request_id)
        if score is None or not score.done:
            return None
        del self.prompts[request_id]
        return score.entries

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams], steps: list[int] | None = None
    ) -> list[SampledToken]:
        """logits: [S, V] fp32, one row per sequence that samples this step; steps: tokens each has
        generated so far (min_tokens, and the position in a seeded random stream); 0 when not given."""
        assert logits.shape[0] == len(params) == len(request_ids), "one logits row per sampling request"
        steps = steps if steps is not None else [0] * len(params)
        greedy = [p.greedy for p in params]
        x = logits
        if any(p.processed for p in params):
            x = self._process(x, request_ids, params, steps)
        if all(greedy):
            tokens = x.argmax(-1)
        else:
            tokens = self._sample(x, params, steps, greedy)
        self._advance(request_ids, params, tokens)
        ids = tokens.tolist()
        lps = self._logprobs(logits, tokens, params)
        return [SampledToken(t, lps.get(i)) for i, t in enumerate(ids)]

    def _process(
        self, x: torch.Tensor, request_ids: list[str], params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        vocab, dev = x.shape[1], x.device
        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items() if t < vocab]
        if bias:
            rows, toks, vals = zip(*bias)
            x = lp.add_bias(x, _long(rows, dev), _long(toks, dev), torch.tensor(vals, dtype=x.dtype, device=dev))
        pen = [i for i, p in enumerate(params) if p.penalized]
        if pen:
            idx = _long(pen, dev)
            slots = self.counts.slots([request_ids[i] for i in pen], vocab, dev)
            counts = self.counts.output[slots]  # [P, V]
            seen = self.counts.prompt[slots] | (counts > 0)
            sub = lp.repetition_penalty(x[idx], seen, _col([params[i].repetition_penalty for i in pen], dev))
            sub = lp.presence_frequency(
                sub,
                counts,
                _col([params[i].presence_penalty for i in pen], dev),
                _col([params[i].frequency_penalty for i in pen], dev),
            )
            x = x.index_copy(0, idx, sub)
        blocked = [
            (i, t)
            for i, p in enumerate(params)
            if steps[i] < p.min_tokens
            for t in self._min_tokens_blocked(p)
            if t < vocab
        ]
        if blocked:
            rows, toks = zip(*blocked)
            x = x.index_put((_long(rows, dev), _long(toks, dev)), torch.tensor(lp.NEG_INF, device=dev))
        guided = [i for i, rid in enumerate(request_ids) if rid in self.grammars]
        if guided:
            idx = _long(guided, dev)
            allowed = lp.unpack_bitmask(self._grammar_mask([request_ids[i] for i in guided], vocab), vocab).to(dev)
            x = x.index_copy(0, idx, x[idx].masked_fill(~allowed, lp.NEG_INF))
        return x

    def _min_tokens_blocked(self, p: SamplingParams) -> list[int]:
        # NOTE: a structured output's grammar decides when EOS may come (blocking it could leave no token).
        eos = [] if p.ignore_eos or p.structured is not None else list(self.eos_token_ids)
        return eos + list(p.stop_token_ids or ())

    def distribution(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """The logits a sampled row draws from (processors, mask and warpers applied; -inf: excluded), without
        picking or advancing any state: what tests hold against transformers' processors."""
        x = self._process(logits, request_ids, params, steps) if any(p.processed for p in params) else logits
        return self._warp(x, params, [p.greedy for p in params])

    def _warp(self, x: torch.Tensor, params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p (off for greedy rows, whose argmax they would not change)."""
        vocab, dev = x.shape[1], x.device
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        if any(t != 1.0 for t in temps):
            x = lp.temperature(x, _col(temps, dev))
        ks = [vocab if g or not p.top_k or p.top_k >= vocab else p.top_k for p, g in zip(params, greedy)]
        # NOTE: 1 - top_p in Python floats, then float32: what transformers' TopP compares against.
        floors = [-1.0 if g or p.top_p >= 1.0 else 1.0 - p.top_p for p, g in zip(params, greedy)]
        cut = [i for i, (k, f) in enumerate(zip(ks, floors)) if k < vocab or f > -1.0]
        if cut:
            rows = _long(cut, dev)
            k_t, floor_t = _long([ks[i] for i in cut], dev), _col([floors[i] for i in cut], dev)
            # NOTE: with a top-k on every cut row, a topk of the largest k does what a sort of the vocabulary would.
            cut_fn = lp.top_k_top_p_from_top_k if all(ks[i] < vocab for i in cut) else lp.top_k_top_p
            sub = cut_fn(x if len(cut) == len(ks) else x[rows], k_t, floor_t)
            x = sub if len(cut) == len(ks) else x.index_copy(0, rows, sub)
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        if any(min_ps):
            x = lp.min_p(x, _col(min_ps, dev))
        return x

    def _sample(
        self, x: torch.Tensor, params: list[SamplingParams], steps: list[int], greedy: list[bool]
    ) -> torch.Tensor:
        vocab, dev = x.shape[1], x.device
        processed = x
        probs = self._warp(x, params, greedy).softmax(-1)
        # Inverse-CDF sampling, one uniform draw per row: a seeded row's comes from (seed, step) alone.
        uniform = 1.0 - torch.rand(len(params), device=dev)  # (0, 1]
        seeded = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
        if seeded:
            uniform[_long(seeded, dev)] = torch.tensor(
                [_seeded_uniform(params[i].seed, steps[i]) for i in seeded], dtype=uniform.dtype, device=dev
            )
        cdf = probs.cumsum(-1)
        # NOTE: the first index whose cumulative mass reaches u x total: a token of probability 0 adds nothing to
        # the cumulative mass, so it is never the first to reach it (u > 0).
        tokens = torch.searchsorted(cdf, (uniform.unsqueeze(1) * cdf[:, -1:]).contiguous()).squeeze(1)
        tokens = tokens.clamp_(max=vocab - 1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=dev), processed.argmax(-1), tokens)
        return tokens

    def _advance(self, request_ids: list[str], params: list[SamplingParams], tokens: torch.Tensor) -> None:
        """Count penalized requests' tokens and move grammars past them."""
        pen = [i for i, p in enumerate(params) if p.penalized]
        if pen:
            dev = tokens.device
            slots = self.counts.slots([request_ids[i] for i in pen], self.counts.output.shape[1], dev)
            self.counts.record(slots, tokens[_long(pen, dev)])
        guided = [(self.grammars[rid], i) for i, rid in enumerate(request_ids) if rid in self.grammars]
        if guided:
            picked = tokens.tolist()
            ok = self._grammar_executor().consume_token_par([(m, picked[i]) for m, i in guided])
            bad = [request_ids[i] for (m, i), good in zip(guided, ok) if not good]
            assert not bad, f"grammar refused a token its own mask allowed: {bad} ({guided[0][0].get_error()})"

    def _grammar_mask(self, request_ids: list[str], vocab: int) -> torch.Tensor:
        """[G, ceil(V / 32)] int32 bitmask of what each grammar allows next, filled in one call."""
        words = (vocab + 31) // 32
        mask = torch.zeros(len(request_ids), words, dtype=torch.int32)
        matchers = [(self.grammars[rid], j) for j, rid in enumerate(request_ids)]
        self._grammar_executor().unsafe_compute_mask_ptr(matchers, mask.data_ptr(), words * 4, len(request_ids))
        errors = [(rid, m.get_error()) for (m, _), rid in zip(matchers, request_ids) if m.is_error()]
        assert not errors, f"grammar in an error state: {errors}"
        return mask

    def _grammar_executor(self):
        if self._executor is None:
            import llguidance

            # NOTE: one thread: the model's compute threads are bound to the cores; masks of small JSON
            # grammars take microseconds each.
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._executor

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> dict[int, TokenLogprobs]:
        """Logprobs of the model's own distribution (before any processing), as vLLM reports by default."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return {}
        idx = _long(rows, logits.device)
        logp = torch.log_softmax(logits[idx], -1)
        chosen = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
        top_n = max(params[i].logprobs for i in rows)
        top_vals, top_ids = torch.topk(logp, top_n) if top_n else (logp[:, :0], logp[:, :0].long())
        top_vals, top_ids, picked = top_vals.tolist(), top_ids.tolist(), tokens[idx].tolist()
        out = {}
        for j, i in enumerate(rows):
            n = params[i].logprobs
            out[i] = TokenLogprobs(picked[j], chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
        return out

    # -- prompt logprobs ----------------------------------------------------------------------
    @torch.inference_mode()
    def score_prompts(
        self, chunks: list, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """For the chunks (in the model's row order, hidden: [T, H]) of requests that asked for prompt
        logprobs: the logprob of each next prompt token, its rank and the top-n. Positions already scored
        (a chunk computed again after a preemption) are skipped."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[PromptScore] = []
        row = 0
        for c in chunks:
            score = self.prompts.get(c.request_id)
            n = len(c.token_ids)
            if score is not None:
                lo, hi = max(c.start_pos, score.scored), min(c.start_pos + n, len(score.prompt) - 1)
                if lo == score.scored:  # positions come in order; anything else was scored already
                    rows += range(row + lo - c.start_pos, row + hi - c.start_pos)
                    targets += score.prompt[lo + 1 : hi + 1]
                    owners += [score] * (hi - lo)
                    score.scored = max(score.scored, hi)
            row += n
        for start in range(0, len(rows), PROMPT_ROWS_PER_PASS):
            sl = slice(start, start + PROMPT_ROWS_PER_PASS)
            self._score_rows(hidden, rows[sl], targets[sl], owners[sl], compute_logits)

    @staticmethod
    def _score_rows(
        hidden: torch.Tensor, rows: list[int], targets: list[int], owners: list[PromptScore], compute_logits
    ) -> None:
        dev = hidden.device
        logp = torch.log_softmax(compute_logits(hidden[_long(rows, dev)]).float(), -1)  # [R, V]
        target = _long(targets, dev).unsqueeze(1)
        chosen = logp.gather(1, target)
        ranks = ((logp > chosen).sum(-1) + 1).tolist()
        top_n = max(o.top_n for o in owners)
        top_vals, top_ids = torch.topk(logp, top_n) if top_n else (logp[:, :0], logp[:, :0].long())
        chosen, top_vals, top_ids = chosen.squeeze(1).tolist(), top_vals.tolist(), top_ids.tolist()
        for j, owner in enumerate(owners):
            n = owner.top_n
            owner.entries.append(
                TokenLogprobs(targets[j], chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])), rank=ranks[j])
            )


_M32 = 0xFFFFFFFF


def _mix32_int(x: int) -> int:
    """A 32-bit integer hash (xor-shift-multiply rounds)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def _seeded_uniform(seed: int, step: int) -> float:
    """A uniform draw in (0, 1) that depends only on (seed, step): a request's tokens are the same whatever it is
    batched with and after a preemption, and no generator per request is kept."""
    h = _mix32_int(_mix32_int((seed & _M32) ^ _mix32_int(((seed >> 32) & _M32) ^ 0x632BE5AB)) ^ (step & _M32))
    return ((h >> 8) + 0.5) / (1 << 24)


def _long(values, dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=dev)


def _col(values: list[float], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)
