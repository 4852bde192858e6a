"""``python -m dora_rl`` is the ``dora-rl`` command."""

import sys

from dora_rl.cli import main

sys.exit(main())
