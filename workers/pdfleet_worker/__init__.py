"""pdfleet's data plane: the inference engine, the OpenAI-compatible worker server and the router."""
