"""Tests of the pdfleet.io API: models, CRDs, admission (schema + CEL), validation."""
