"""Storage below the DRAM slab: the tier seam (:mod:`kvtier.tiers.seam`), the scheduler's
index of a tier (:mod:`kvtier.tiers.catalog`), the local disk tier (:mod:`kvtier.tiers.disk`,
:mod:`kvtier.tiers.directory`) and an in-memory tier for tests (:mod:`kvtier.tiers.fake`)."""

DRAM = "dram"
"""The tier name of the host-DRAM slab (the ``tier`` label of kvtier's metrics)."""
TIER_NAMES = (DRAM, "disk", "remote")
"""Every tier's name, in order from the top: each has its series from start-up."""
