"""What the router and the worker both speak: OpenAI request types and their checks, error objects, response builders,
SSE framing and heartbeats, shared-secret auth, the draining server. No torch, no engine (a contract)."""
