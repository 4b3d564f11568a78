"""Oracle-driven fault-injection harness: vLLM's real scheduler, kvtier, simulated workers.

See tests/harness/README.md. Modules: :mod:`.workload` (seeded scenarios), :mod:`.content`
(the fake model), :mod:`.transport` (late, lossy copies), :mod:`.runner` (a worker),
:mod:`.oracle` (the checks), :mod:`.driver` (the engine loop), :mod:`.bugs` (planted bugs),
:mod:`.run` (batches of scenarios, also as ``python -m harness.run``).
"""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
