"""Tests of the data plane, one folder per folder of workers/pdfleet_worker (wire, engine, layers, model, kv_transfer,
server, router)."""
