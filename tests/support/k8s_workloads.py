"""The emulator's controllers' old module path: they live in :mod:`tests.support.k8s.workloads` now (see its
docstring); this re-exports them for the modules that import them from here."""

from tests.support.k8s.workloads import *  # noqa: F401,F403 (the re-export is the point)
from tests.support.k8s.workloads import MAX_PASSES, WATCHED, Workloads, requests_of, template_hash  # noqa: F401
