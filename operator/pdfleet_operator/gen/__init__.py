"""Generators of checked-in files: CRDs, chart values and schema, dashboards, alert rules (`make generate`)."""
