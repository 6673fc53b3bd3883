"""Pure decisions (placement, autoscaler, rollback, cost, ...): no I/O, no kopf, no Kubernetes client, no Prometheus."""
