"""pdfleet's control plane: the API models, decision code and the Kubernetes/local/simulation backends."""

__version__ = "0.1.0"
