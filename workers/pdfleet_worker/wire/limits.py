"""What one request may ask for (`Limits`): the worker's flags and model set it, its /load reports it, and the router
applies the strictest of a tier's workers. No torch."""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_MAX_PROMPTS = 64  # prompts in one /v1/completions request (`--max-prompts`)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for. The worker's flags and model set it and its /load reports it;
    the router applies the strictest of a tier's workers before any work. None: not known here."""

    max_model_len: int | None = None  # prompt + completion tokens
    max_tokens: int | None = None  # completion tokens (`--max-tokens-limit`)
    max_n: int | None = None  # choices per prompt (`--max-n`)
    max_logprobs: int | None = None  # logprobs / top_logprobs (`--max-logprobs`)
    max_prompts: int | None = None  # prompts in one /v1/completions request (`--max-prompts`)

    def to_json(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> "Limits":
        """From a worker's /load `limits` (bad or missing values are unknown, never a crash)."""
        raw = raw if isinstance(raw, dict) else {}
        return cls(
            **{
                f.name: v
                for f in dataclasses.fields(cls)
                if isinstance(v := raw.get(f.name), int) and not isinstance(v, bool) and v >= 0
            }
        )

    @classmethod
    def strictest(cls, all_limits: list["Limits"]) -> "Limits":
        def least(name: str) -> int | None:
            known = [v for lim in all_limits if (v := getattr(lim, name)) is not None]
            return min(known) if known else None

        return cls(**{f.name: least(f.name) for f in dataclasses.fields(cls)})
