"""``python -m kvshm`` runs the ``kvshm`` command."""

import sys

from kvshm.cli import main

sys.exit(main())
