"""Packaging contracts: the source folders import under their package names, never as `operator`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_packages_import_from_repo_root_without_shadowing_stdlib_operator():
    result = _python("import pdfleet_operator, pdfleet_worker, operator; operator.itemgetter; print(operator.__file__)")
    assert result.returncode == 0, result.stderr
    assert "/operator/" not in result.stdout.replace("operator.py", "")


def test_cli_and_decision_code_load_without_torch():
    """The operator image has no torch: building the whole CLI and the API must not import it."""
    result = _python(
        "import sys; from pdfleet_operator import cli, api, validate; from pdfleet_operator.gen import crds; "
        "from pdfleet_operator.api import admission; "
        "cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'kopf' not in sys.modules and 'kubernetes' not in sys.modules"
    )
    assert result.returncode == 0, result.stderr


def test_worker_cli_and_config_load_without_torch():
    """`pdfleet worker/router --help` and the worker's flag parsing must not pay for (or need) torch."""
    result = _python(
        "import sys; from pdfleet_operator import cli; "
        "[cli.build_parser([c]) for c in ('worker', 'router', 'model', 'simulate')]; "
        "import pdfleet_worker.server.worker_config, pdfleet_worker.router.app; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    assert result.returncode == 0, result.stderr


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
