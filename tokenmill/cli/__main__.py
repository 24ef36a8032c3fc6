"""``python -m tokenmill.cli``: the ``tokenmill`` command."""

from tokenmill.cli.command import main

raise SystemExit(main())
