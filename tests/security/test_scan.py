"""The checkov scan's bookkeeping (tests/security/scan.py): findings held to the documented allow-list, entries that
match nothing reported; the scan itself runs in `make checkov` (its own virtualenv, about a minute and a half)."""

from __future__ import annotations

from tests.security import scan


def finding(check: str, file: str, resource: str) -> dict:
    return {"check_id": check, "file_path": f"/{file}", "resource": resource, "check_name": check}


def test_findings_are_allowed_only_where_an_entry_says_why() -> None:
    entries = scan.load_allowlist()
    assert entries and all(e.why.strip() for e in entries)
    report = {
        "results": {
            "passed_checks": [{}] * 5,
            "failed_checks": [
                finding("CKV_K8S_11", "example-qwen2-7b.yaml", "Deployment.default.qwen2-7b-colocated-l40s-48gb"),
                finding(
                    "CKV_K8S_11", "chart-defaults.yaml", "Deployment.pdfleet-system.pdfleet-operator"
                ),  # no CPU limit
                finding("CKV_K8S_21", "chart-defaults.yaml", "Service.default.pdfleet-operator"),
            ],
        }
    }
    verdict = scan.judge(report, entries)
    assert [scan.key(f) for f in verdict.allowed] == [
        "example-qwen2-7b.yaml:Deployment.default.qwen2-7b-colocated-l40s-48gb"
    ]
    assert {f["check_id"] for f in verdict.failed} == {"CKV_K8S_11", "CKV_K8S_21"}, "the chart's operator keeps limits"
    assert not verdict.ok and verdict.summary()["passed"] == 5
    assert {e.check for e in verdict.unused} == {e.check for e in entries} - {"CKV_K8S_11"}, "unused entries are said"
