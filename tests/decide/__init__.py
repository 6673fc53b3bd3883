"""Tests of the pure decision code (placement, autoscaler, rollback, cost, ...): no cluster, no network."""
