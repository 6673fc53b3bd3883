"""Builders of OpenAI response bodies and stream chunks (ids, usage, model cards, the 404 for an unknown model); the
worker's serving and the router call them. No torch."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pdfleet_worker.wire.errors import RequestError


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def model_card(model_id: str, created: int, **extra: Any) -> dict[str, Any]:
    """One entry of /v1/models (and the body of /v1/models/{id})."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pdfleet", **extra}


def model_not_found(model_id: str, served: list[str]) -> RequestError:
    return RequestError(
        404,
        f"The model `{model_id}` does not exist; this server serves "
        f"{', '.join(f'`{m}`' for m in served) or 'no model yet'}",
        param="model",
        code="model_not_found",
    )


def assistant_message(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chat_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
