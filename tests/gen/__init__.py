"""Tests of the generated files: CRDs, chart (Helm's own engine), dashboards, alert rules (promtool)."""
