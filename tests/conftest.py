"""Session-wide test settings.

Hypothesis runs derandomized by default (profile ``ci``): every run draws the same examples,
so a CI run cannot pass by missing a bug that another run would have found, and a failure
reproduces. Random exploration is for soak runs (``KVTIER_SOAK=1``, the ``soak`` marker):
profile ``soak`` draws fresh examples each time.
"""

from __future__ import annotations

import os

from hypothesis import settings

SOAK = os.environ.get("KVTIER_SOAK") == "1"

settings.register_profile("ci", derandomize=True)
settings.register_profile("soak", derandomize=False)
settings.load_profile("soak" if SOAK else "ci")

