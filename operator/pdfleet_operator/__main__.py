"""`python -m pdfleet_operator` is the `pdfleet` command."""

import sys

from pdfleet_operator.cli import main

sys.exit(main())
