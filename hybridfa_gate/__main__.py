"""``python -m hybridfa_gate``: the gate's command line (``cli.main``)."""

import sys

from hybridfa_gate.cli import main

sys.exit(main())
