"""Batched logits processors: each maps [S, V] fp32 logits and per-row parameter tensors to new logits in a few tensor
ops, with no loop over rows; the Sampler chains them.

Each computes what transformers' processor of the same name computes (same arithmetic, same dtype), so that
tests can hold them to its LogitsProcessors exactly; presence/frequency penalties follow OpenAI's definition
(transformers has none)."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def add_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """logit_bias (transformers' SequenceBiasLogitsProcessor for one-token sequences):
    logits[rows, tokens] += values."""
    return logits.index_put((rows, tokens), values, accumulate=True)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """seen: [S, V] bool (the token is in the prompt or the output); penalty: [S, 1]. A seen token's logit is
    divided by the penalty when positive and multiplied by it when negative (RepetitionPenaltyLogitsProcessor)."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """counts: [S, V] output-token counts; presence/frequency: [S, 1]. OpenAI's
    logits - frequency * count - presence * (count > 0)."""
    logits = logits - frequency * counts
    return logits - presence * (counts > 0)


def block(logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """blocked: [S, V] bool -> -inf (min_tokens: EOS and stop token ids until enough tokens came)."""
    return logits.masked_fill(blocked, NEG_INF)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, W] int32, bit j of word w allowing token 32 * w + j -> [S, vocab] bool (allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [S, W, 32]
    allowed = bits.view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def temperature(logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """temp: [S, 1] (1 where the row is greedy: its argmax does not change)."""
    return logits / temp


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """k: [S] int64 in [1, V] (V: off); top_p_floor: [S, 1], 1 - top_p (-1: off). transformers' TopK then TopP
    warpers from one ascending sort: the k-th largest value is asc[V - k]; masking what lies below it keeps
    the sorted order, so the top-p cumulative mass is taken over the same sorted values TopP would sort."""
    vocab = logits.shape[1]
    asc, order = torch.sort(logits, dim=-1)
    kth = asc.gather(1, (vocab - k).unsqueeze(1))  # [S, 1]
    below_k = asc < kth
    cum = asc.masked_fill(below_k, NEG_INF).softmax(-1).cumsum(-1)
    drop = below_k | (cum <= top_p_floor)
    drop[:, -1] = False  # the most likely token always stays
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def top_k_top_p_from_top_k(logits: torch.Tensor, k: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """top_k_top_p when every row has a top-k (k < V): one topk of the largest k instead of a sort of the vocabulary.
    What TopP sorts after TopK is -inf everywhere but the k survivors, so that ascending row is built as it would
    sort ([-inf] * (V - k) + the top k ascending) and its softmax and cumulative sum are the same numbers. A tie
    at the k-th value (TopK keeps every tied token) takes the sorting path."""
    vocab = logits.shape[1]
    kmax = int(k.max())
    vals, idx = torch.topk(logits, kmax)  # [S, kmax], descending
    kth = vals.gather(1, (k - 1).unsqueeze(1))
    if bool(((logits >= kth).sum(-1) > k).any()):
        return top_k_top_p(logits, k, top_p_floor)
    rank = torch.arange(kmax - 1, -1, -1, device=logits.device)  # of each ascending column: 0 = the largest
    beyond_k = rank[None, :] >= k[:, None]  # [S, kmax]
    tail = vals.flip(-1).masked_fill(beyond_k, NEG_INF)  # the sorted row's last kmax columns
    asc = torch.full_like(logits, NEG_INF)
    asc[:, vocab - kmax :] = tail
    # NOTE: the columns before the tail hold probability 0.0 exactly, so the cumulative sum starts at the tail.
    cum = asc.softmax(-1)[:, vocab - kmax :].cumsum(-1)
    drop = beyond_k | (cum <= top_p_floor)
    drop[:, -1] = False
    return torch.full_like(logits, NEG_INF).scatter_(1, idx.flip(-1), tail.masked_fill(drop, NEG_INF))


def min_p(logits: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """floor: [S, 1] (0: off). Drops tokens less likely than floor x the most likely one's probability
    (transformers' MinPLogitsWarper; the most likely token is never dropped since floor <= 1)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < floor * probs.amax(-1, keepdim=True), NEG_INF)
