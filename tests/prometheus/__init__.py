"""Tests of the one Prometheus reader against real Prometheus and real exporters."""
