"""``python -m checkpoints``: inspect and verify checkpoint directories (see ``--help``)."""
import sys

from .cli import main

sys.exit(main())
