"""Integrations of kvferry with inference servers.

Each integration lives in its own module and imports its server lazily, so
``import kvferry`` (and ``import kvferry.integrations``) never needs the server:

- :mod:`kvferry.integrations.vllm`: ``KvferryConnector``, a vLLM V1 KV connector for
  disaggregated prefill/decode (see ``docs/vllm.md`` for the vLLM versions it supports): a
  package with one module per concern. Its pure modules import without vLLM:
  :mod:`~kvferry.integrations.vllm.mapping` (which bytes each decode rank reads from
  which prefill rank, and the compatibility check),
  :mod:`~kvferry.integrations.vllm.layout` and :mod:`~kvferry.integrations.vllm.reads`.
  :mod:`kvferry.integrations.vllm.bounded_output` is the vLLM general plugin
  ``kvferry_bounded_output``, bounding the worker's output-copy waits (also importable
  by its former name ``kvferry.integrations.vllm_bounded_output``, as
  ``kvferry.integrations.vllm_bench`` still runs the connector's bench).
- :mod:`kvferry.integrations.sglang`: a transfer backend for SGLang's prefill/decode
  disaggregation (needs ``sglang==0.5.23``; see ``docs/sglang.md``).
- :mod:`kvferry.integrations._kv_layout`: what both the vLLM connector and the SGLang
  backend share, pure: the KV descriptor, which heads a rank holds, and the byte ranges
  of one token and head inside a piece. Integrations import it; it imports none of them.
- :mod:`kvferry.integrations.lmcache`: for LMCache's multiprocess server, an L2 adapter
  (``KvferryL2Adapter``, loaded through LMCache's plugin adapter type); for its
  in-process engine, a remote tier and the P2P/PD channel (needs ``lmcache==0.5.6``;
  see ``docs/lmcache.md``).
"""

__all__: list[str] = []
