"""Integrations of kvferry with inference servers.

Each integration lives in its own module and imports its server lazily, so
``import kvferry`` (and ``import kvferry.integrations``) never needs the server:

- :mod:`kvferry.integrations.vllm`: ``KvferryConnector``, a vLLM V1 KV connector for
  disaggregated prefill/decode (needs ``vllm==0.33.0``; see ``docs/vllm.md``).
- :mod:`kvferry.integrations.vllm_mapping` (pure Python, no vLLM): which bytes each
  decode rank reads from which prefill rank (heterogeneous TP, MLA, block sizes,
  layouts, prefix hits, sliding windows) and the compatibility check; used by the
  connector through :mod:`~kvferry.integrations.vllm_hetero` and
  :mod:`~kvferry.integrations.vllm_reads`.
- :mod:`kvferry.integrations.vllm_bounded_output`: the vLLM general plugin
  ``kvferry_bounded_output``, bounding the worker's output-copy waits.
"""

__all__: list[str] = []
