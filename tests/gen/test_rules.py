"""The generated alerting rules: fresh, accepted by promtool, and their timing unit-tested by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdfleet_operator.gen import alerts
from tests.support.components import binary

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards/rules/pdfleet.rules.yaml"


def test_rule_file_is_fresh():
    assert RULES.read_text() == alerts.render_rule_file(), "run `pdfleet rules` and commit the result"


def test_promtool_check_rules():
    result = subprocess.run([binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_including_for_timing():
    tests = sorted(str(p) for p in (ROOT / "dashboards/rules/tests").glob("*.yaml"))
    assert len(tests) >= 2
    result = subprocess.run([binary("promtool"), "test", "rules", *tests], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


def test_rollback_alert_defaults_match_the_api_defaults():
    from pdfleet_operator.api.inference_deployment import RollbackSpec

    spec, rule = RollbackSpec(), alerts.RollbackRule()
    assert (rule.threshold, rule.window, rule.for_, rule.min_requests) == (
        spec.error_ratio_threshold,
        spec.window,
        spec.for_,
        spec.min_requests,
    )
