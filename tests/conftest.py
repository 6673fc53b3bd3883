"""Test-suite wiring: fixture plugins and the opt-in markers (e2e needs kind + Docker, gpu needs CUDA, measure
compares against timings of this machine and wants it to itself)."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.support.k8s_fixtures", "tests.support.prometheus"]

OPT_IN = {"e2e": "--run-e2e", "gpu": "--run-gpu", "measure": "--run-measure"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-e2e", action="store_true", help="run the kind end-to-end tests (need Docker)")
    parser.addoption("--run-gpu", action="store_true", help="run the tests that need a CUDA GPU")
    parser.addoption(
        "--run-measure",
        action="store_true",
        help="run the tests that compare a model against timings taken on this machine (make validate-sim)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, option in OPT_IN.items():
            if marker in item.keywords and not config.getoption(option):
                item.add_marker(pytest.mark.skip(reason=f"opt-in: pass {option} to run {marker} tests"))
