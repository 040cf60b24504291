"""``python -m slurm``: render and submit megaloop training jobs and isoFLOP sweeps (see ``--help``)."""
import sys

from slurm.cli import main

sys.exit(main())
