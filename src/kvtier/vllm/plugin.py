"""vLLM general plugin: registers the connector under the short name ``kvtier``.

Installed through the ``vllm.general_plugins`` entry point (pyproject.toml), so that
``--kv-transfer-config '{"kv_connector": "kvtier", "kv_role": "kv_both"}'`` works without a
module path.

vLLM runs the plugins in every one of its processes, the one that starts the engine first; so
registering also makes that process the reporter of kvtier's start-up failures
(:func:`kvtier.vllm.startup.install_reporter`), whose one line ends the output.
"""

from __future__ import annotations

SHORT_NAME = "kvtier"


def register() -> None:
    from kvtier.vllm.startup import install_reporter

    install_reporter()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if SHORT_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return  # every vLLM process runs the plugins; register once per process
    KVConnectorFactory.register_connector(SHORT_NAME, "kvtier.vllm.connector", "KvtierConnector")
