"""``python -m jobs``: see jobs/cli.py."""

import sys

from jobs.cli import main

sys.exit(main())
