"""``python -m stepscope.cli``: the same command as ``stepscope``."""

from stepscope.cli import main

raise SystemExit(main())
