"""vitpool as the vision encoder of a stock vLLM deployment (vLLM's encoder-cache connector seam).

- `layouts`: what vLLM's encoder cache holds per image of each family (`vllm_embedding`).
- `publisher`: `FilePublisher`, entries as vLLM's file connectors read them.
- `store`: the pool's embedding store, a Ray actor (`StorePublisher`, `StoreReader`).
- `connector`: `VitpoolECConnector` (the store, no shared disk) and `VitpoolFileConnector`; loaded
  by vLLM by module path, the only module here that imports vLLM.
- `gateway`: the HTTP gateway in front of vLLM's OpenAI server (`python -m
  vitpool.integrations.vllm.gateway`); its command line (`gateway_cli`), start-up checks against
  the vLLM checkpoint (`gateway_checks`), image downloads (`gateway_fetch`) and counters
  (`gateway_stats`).
"""
