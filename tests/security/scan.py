"""`make checkov`: checkov (its own virtualenv, .venv-checkov) over the chart's render and every example's render,
its findings held to tests/security/checkov-allowlist.yaml; prints passed / allow-listed / failed and a JSON line.

    python -m tests.security.scan --checkov .venv-checkov/bin/checkov [--out DIR]

Renders: the chart with its default values (Helm's own engine, helm-python-sdk) and `pdfleet render` of each
examples/*.yaml with the example classes (the objects the operator would create, PodMonitor and PrometheusRule
included). Exit status 1 when a finding is not allow-listed or an allow-list entry matches nothing (a fixed
finding leaves the list).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALLOWLIST = Path(__file__).with_name("checkov-allowlist.yaml")


@dataclass(frozen=True)
class Entry:
    """One accepted finding: a check id, a glob over '<file>:<resource>', and why."""

    check: str
    where: str
    why: str

    def matches(self, finding: Mapping) -> bool:
        return finding["check_id"] == self.check and fnmatch.fnmatchcase(key(finding), self.where)


@dataclass(frozen=True)
class Verdict:
    passed: int
    allowed: list[Mapping]
    failed: list[Mapping]
    unused: list[Entry]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.unused

    def summary(self) -> dict:
        return {
            "passed": self.passed,
            "allow_listed": len(self.allowed),
            "failed": len(self.failed),
            "unused_allow_list_entries": len(self.unused),
        }


def key(finding: Mapping) -> str:
    return f"{Path(finding['file_path']).name}:{finding['resource']}"


def load_allowlist(path: Path = ALLOWLIST) -> list[Entry]:
    entries = [Entry(**e) for e in yaml.safe_load(path.read_text())]
    for e in entries:
        if not e.why.strip():
            raise ValueError(f"{path}: {e.check} {e.where}: an entry says why")
    return entries


def judge(report: Mapping, entries: Sequence[Entry]) -> Verdict:
    """Findings of a checkov JSON report (one framework's) sorted into allow-listed and failed."""
    results = report["results"]
    allowed, failed, used = [], [], set()
    for f in results["failed_checks"]:
        hit = next((e for e in entries if e.matches(f)), None)
        if hit is None:
            failed.append(f)
        else:
            allowed.append(f)
            used.add(hit)
    return Verdict(len(results["passed_checks"]), allowed, failed, [e for e in entries if e not in used])


def render_all(out: Path) -> list[Path]:
    """The chart with default values and every example's objects, one YAML file each."""
    from tests.gen.chart import helm

    out.mkdir(parents=True, exist_ok=True)
    files = [out / "chart-defaults.yaml"]
    files[0].write_text(yaml.safe_dump_all(helm.render({}), sort_keys=False))
    classes = ROOT / "examples" / "acceleratorclasses.yaml"
    for spec in sorted((ROOT / "examples").glob("*.yaml")):
        if spec == classes:
            continue
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdfleet_operator.cli",
                "render",
                str(spec),
                "--classes",
                str(classes),
                "--monitoring",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pdfleet render {spec.name}: {done.stderr.strip()}")
        path = out / f"example-{spec.stem}.yaml"
        path.write_text(done.stdout)
        files.append(path)
    return files


def run_checkov(checkov: str, directory: Path) -> dict:
    done = subprocess.run(
        [checkov, "-d", str(directory), "--framework", "kubernetes", "-o", "json", "--compact"],
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):  # 1: findings
        raise RuntimeError(f"checkov failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return report[0] if isinstance(report, list) else report


def describe(findings: Iterable[Mapping]) -> list[str]:
    return [f"  {f['check_id']} {key(f)}: {f['check_name']}" for f in findings]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkov", default=str(ROOT / ".venv-checkov" / "bin" / "checkov"))
    p.add_argument("--out", help="keep the rendered files here (default: a temporary directory)")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="pdfleet-checkov-"))
    files = render_all(out)
    verdict = judge(run_checkov(a.checkov, out), load_allowlist())
    s = verdict.summary()
    print(f"checkov over {len(files)} renders ({', '.join(f.name for f in files)}):")
    print(f"  {s['passed']} checks passed, {s['allow_listed']} allow-listed, {s['failed']} failed")
    if verdict.failed:
        print("not allow-listed (fix them, or add an entry with its reason to tests/security/checkov-allowlist.yaml):")
        print("\n".join(describe(verdict.failed)))
    for e in verdict.unused:
        print(f"allow-list entry {e.check} {e.where} matches nothing: remove it")
    print(json.dumps(s))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
