"""The Kubernetes backend: kopf triggers, the reconciler, the API client, render, revisions and the loops."""
