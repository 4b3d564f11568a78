"""``python -m kvtier.bench.transfer``: the same as ``kvtier bench transfer``."""

from kvtier.bench.transfer import main

raise SystemExit(main())
