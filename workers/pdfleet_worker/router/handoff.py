"""The prefill -> decode hand-off each engine speaks: what the router sends a prefill worker, what it takes from the
answer, and what the decode worker gets; the proxy calls it. Pure, no I/O, no torch.

pdfleet: the prefill worker gets the client's request with `kv_transfer_params: {"do_remote_decode": true}` and
answers with the params a decode worker pulls the KV with (pdfleet_worker.kv_transfer.params), always.

vllm (vLLM's disaggregated serving, as its NixlConnector proxy drives it): the prefill worker gets the request as
one token, not streamed (`max_tokens` 1, `max_completion_tokens` 1 if set, no `stream_options`, no `min_tokens` /
`min_completion_tokens`) with `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
"remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}`; its answer's
`kv_transfer_params` (NIXL: do_remote_prefill, remote_engine_id, remote_request_id, remote_block_ids, remote_host,
remote_port, tp_size, ...) go to the decode worker with the client's own request, untouched: they belong to the
two workers' KV connector, not to the router.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdfleet_worker.kv_transfer.params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL
from pdfleet_worker.router import engines

KV_TRANSFER_PARAMS = "kv_transfer_params"
# What vLLM's proxy asks of a prefill worker: compute the prompt's KV, hold it for a remote decode.
VLLM_PREFILL_PARAMS = {
    DO_REMOTE_DECODE: True,
    DO_REMOTE_PREFILL: False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling limits a one-token prefill cannot honour (vLLM refuses min_tokens > max_tokens).
_VLLM_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


class BadPrefillAnswer(ValueError):
    """The prefill worker's 200 carries no usable hand-off (a protocol break, not the request's fault)."""


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What the decode call needs from a prefill answer."""

    params: dict[str, Any] | None  # the decode request's kv_transfer_params; None: the decode worker computes all
    hosts: tuple[str, ...]  # addresses in the params, redacted from whatever reaches the client


def prefill_body(engine: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill worker's request for the client's `body` (which is not changed)."""
    if engine == engines.PDFLEET:
        # NOTE: the client's whole request (a pdfleet prefill worker computes one token of one choice whatever it
        # asks for), so that it refuses, before its prefill, all that the decode worker would.
        return dict(body, kv_transfer_params={DO_REMOTE_DECODE: True})
    assert engine == engines.VLLM, f"no prefill -> decode hand-off for engine {engine!r}"
    out = {k: v for k, v in body.items() if k not in _VLLM_PREFILL_DROPS}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(VLLM_PREFILL_PARAMS))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def from_prefill(engine: str, answer: Any) -> Handoff:
    """The hand-off in a prefill worker's 200 answer (parsed JSON); BadPrefillAnswer if it has none it should."""
    if not isinstance(answer, dict):
        raise BadPrefillAnswer(f"the prefill answer is a {type(answer).__name__}, not an object")
    params = answer.get(KV_TRANSFER_PARAMS)
    if params is None and engine == engines.VLLM:
        # NOTE: as vLLM's own proxy does: a connector that finds the KV by the prompt (a shared store) returns no
        # params, and without a connector the decode worker computes the prompt itself; the proxy counts it.
        return Handoff(None, ())
    if not isinstance(params, dict):
        raise BadPrefillAnswer(
            f"the prefill answer's {KV_TRANSFER_PARAMS} is "
            f"{'missing' if params is None else type(params).__name__}, not an object"
        )
    hosts = tuple(v for k, v in params.items() if isinstance(v, str) and v and k.endswith(("host", "addr")))
    return Handoff(params, hosts)


def decode_body(body: dict[str, Any], handoff: Handoff) -> dict[str, Any]:
    """The decode worker's request: the client's own (streamed or not, every sampling field) plus the hand-off."""
    if handoff.params is None:
        return body
    return dict(body, kv_transfer_params=handoff.params)


def scrub_decode_answer(answer: Any) -> bool:
    """Drop (set to null) a decode answer's own kv_transfer_params in place: vLLM returns them for a KV read-back
    and they name the decode worker's KV side channel; returns whether anything changed."""
    if isinstance(answer, dict) and answer.get(KV_TRANSFER_PARAMS) is not None:
        answer[KV_TRANSFER_PARAMS] = None
        return True
    return False
