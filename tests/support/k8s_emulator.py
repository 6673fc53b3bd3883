"""The Kubernetes API emulator's old module path: everything lives in the package :mod:`tests.support.k8s` now
(its docstring says what the emulator does and does not do); this re-exports what tests, benches and
``python -m tests.support.k8s_emulator`` use from here."""

from tests.support.k8s import *  # noqa: F401,F403 (the re-export is the point)
from tests.support.k8s import __all__  # noqa: F401
from tests.support.k8s.server import main as _main

if __name__ == "__main__":
    _main()
