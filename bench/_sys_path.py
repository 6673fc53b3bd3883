"""Imported first by every bench script: takes bench/ off sys.path before anything else is imported.

NOTE: `python bench/X.py` puts bench/ first on sys.path, and bench/operator.py (its name is a
documented interface) would then shadow the standard library's `operator`, which enum, re, json
and collections import. Import this module before any other.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
assert "operator" not in sys.modules or not getattr(sys.modules["operator"], "__file__", "").startswith(_HERE), (
    "bench/operator.py was imported as the standard library's operator"
)
