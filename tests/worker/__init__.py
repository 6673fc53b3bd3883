"""Tests of the worker engine (issue 3)."""
