"""Prefill/decode KV transfer: the parameters a prefill worker hands out, its leases, and the connectors that move
blocks."""
