"""pdfleet's data plane: wire/ (what router and worker both speak), engine/ over layers/ and model/, kv_transfer/, the
worker's server/ and the router/ (docs/engine.md, docs/serving.md)."""
