"""Storage below the DRAM slab: the tier seam (:mod:`kvtier.tiers.seam`), the scheduler's
index of a tier (:mod:`kvtier.tiers.catalog`), the local disk tier (:mod:`kvtier.tiers.disk`,
:mod:`kvtier.tiers.directory`) and an in-memory tier for tests (:mod:`kvtier.tiers.fake`)."""
