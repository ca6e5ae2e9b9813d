"""P/D across two "machines": the prefill in a network namespace and a PID namespace of
its own (:mod:`netns`), joined to the decode and the router by a veth pair, configured
as docs/vllm.md's "P/D on two machines" says (the prefill's engine listening on every
interface and advertising the address the decode reaches; one secret file on both
sides). Another machine's pids mean nothing here, so kvferry's same-host reads are
refused and the socket carries the KV: the bytes are counted on the pair.

The same checks as :mod:`test_identity`: tokens identical to one instance, one at a time
and concurrently, every prompt token through kvferry, no block held afterwards.
"""

from __future__ import annotations

import netns
import pytest
import serving_harness as h
from test_identity import check_through_kvferry, external_counts

KV_BYTES_PER_TOKEN = 4 * 2 * 4 * 64 * 4  # layers × (K, V) × KV heads × head size × float32


@pytest.fixture
def two_hosts(cluster: h.Cluster) -> h.PD:
    why = netns.missing()
    if why is not None:
        pytest.skip(f"P/D across namespaces: {why}")
    return cluster.get("two-hosts")


@pytest.mark.parametrize("concurrent", [1, 16])
def test_tokens_identical_across_two_hosts(two_hosts: h.PD, single: h.Server, concurrent: int) -> None:
    pd = two_hosts
    assert pd.other_host is not None
    ps = h.prompts(16 if concurrent > 1 else 6, seed=300 + concurrent)
    ref = h.complete_many(single.port, ps, concurrent)
    before = external_counts(pd.decode)
    rx = pd.other_host.received_bytes()
    got = h.complete_many(pd.router.port, ps, concurrent)
    h.assert_identical(ref, got, ps)
    check_through_kvferry(pd, before, got)
    # The KV crossed the pair (the socket, not a same-host read): at least the prompt
    # tokens' KV came from the prefill's namespace.
    moved = pd.other_host.received_bytes() - rx
    kv = sum(o.prompt_tokens for o in got) * KV_BYTES_PER_TOKEN
    assert moved >= kv, f"only {moved} bytes crossed from the prefill's host for {kv} bytes of KV"
    h.assert_no_blocks_held(pd)
