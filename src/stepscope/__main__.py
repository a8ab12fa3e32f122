"""``python -m stepscope``: the same CLI as the ``stepscope`` command."""

import sys

from stepscope.cli import main

sys.exit(main())
