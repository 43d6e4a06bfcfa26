"""``python -m jetrl ...`` is the ``jetrl`` command (the compose image's entry point is ``python -m``)."""

import sys

from jetrl.cli import main

sys.exit(main())
