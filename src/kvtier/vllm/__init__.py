"""The vLLM adapter. ``kvtier.vllm.connector.KvtierConnector`` is the connector class."""
