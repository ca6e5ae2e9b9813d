"""The remote tier's settings: :class:`RemoteOptions`, read from LMCache's
``extra_config`` (keys prefixed ``kvferry.``) and the ``kvferry://HOST:PORT[?k=v]`` URL.

Semantics: URL query parameters override ``extra_config``; an unknown key, a missing
server, a timeout that is not a positive finite number, or a partial TLS triple is a
``ValueError`` naming it, raised when LMCache builds the connector (start-up), never
later. ``secret_file`` wins over ``secret``; its content is stripped of surrounding
whitespace.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from kvferry import Engine

PREFIX = "kvferry."
"""Prefix of this connector's keys in LMCache's ``extra_config``."""


@dataclass
class RemoteOptions:
    """The connector's settings, from LMCache's ``extra_config`` (``kvferry.*``) and the URL.

    ``server``: ``HOST:PORT`` of a ``kvferry serve`` (or a peer id with ``directory``).
    ``timeout``: bound on every call, seconds. ``connect_timeout``: bound on connecting.
    ``secret`` / ``secret_file``: the shared secret the server requires.
    ``directory``: ``etcd://HOST:PORT[,...]`` to find ``server`` by peer id.
    ``tls_cert`` / ``tls_key`` / ``tls_ca``: PEM files for mutual TLS with a server
    started with ``--tls-cert/--tls-key/--tls-ca`` (all three or none).
    ``threads``: threads running pushes and lookups off LMCache's event loop.
    ``parallel``: concurrent transfers a batched get is cut into.
    ``transport``: ``"auto"`` (read a server on this host from its memory with
    ``process_vm_readv``, the socket elsewhere) or ``"tcp"`` (the socket only); unset,
    the environment's ``KVFERRY_TRANSPORT`` (as for the channel), else ``"auto"``.
    """

    server: str
    timeout: float = 5.0
    connect_timeout: float = 2.0
    secret: Optional[bytes] = None
    directory: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_ca: Optional[str] = None
    threads: int = 4
    parallel: int = 4
    transport: str = "auto"

    @staticmethod
    def from_config(config: Any, url: Optional[str] = None) -> "RemoteOptions":
        extra = dict(getattr(config, "extra_config", None) or {})
        opts: dict[str, Any] = {k[len(PREFIX) :]: v for k, v in extra.items() if k.startswith(PREFIX)}
        if url and url.startswith("kvferry://"):
            parsed = urlparse(url)
            if not parsed.hostname or not parsed.port:
                raise ValueError(f"{url!r}: a kvferry URL is kvferry://HOST:PORT[?timeout=S]")
            opts["server"] = f"{parsed.hostname}:{parsed.port}"
            for k, v in parse_qs(parsed.query).items():
                opts[k] = v[-1]
        known = {
            "server",
            "timeout",
            "connect_timeout",
            "secret",
            "secret_file",
            "directory",
            "threads",
            "parallel",
            "tls_cert",
            "tls_key",
            "tls_ca",
            "transport",
        }
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"unknown kvferry option(s) {unknown}; known: {sorted(known)}")
        server = opts.get("server")
        if not server:
            raise ValueError(
                "the kvferry remote tier needs a server: extra_config 'kvferry.server: HOST:PORT' "
                "(or remote_url kvferry://HOST:PORT)"
            )
        secret: Optional[bytes] = None
        if opts.get("secret_file"):
            with open(str(opts["secret_file"]), "rb") as f:
                secret = f.read().strip()
        elif opts.get("secret") is not None:
            s = opts["secret"]
            secret = s.encode() if isinstance(s, str) else bytes(s)
        timeout = float(opts.get("timeout", 5.0))
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"kvferry.timeout must be a positive number of seconds, got {opts.get('timeout')!r}")
        tls = [opts.get(k) for k in ("tls_cert", "tls_key", "tls_ca")]
        if any(t is not None for t in tls) and not all(t is not None for t in tls):
            raise ValueError("kvferry.tls_cert, kvferry.tls_key and kvferry.tls_ca go together")
        return RemoteOptions(
            server=str(server),
            timeout=timeout,
            connect_timeout=float(opts.get("connect_timeout", min(timeout, 2.0))),
            secret=secret,
            directory=opts.get("directory"),
            tls_cert=None if tls[0] is None else str(tls[0]),
            tls_key=None if tls[1] is None else str(tls[1]),
            tls_ca=None if tls[2] is None else str(tls[2]),
            threads=int(opts.get("threads", 4)),
            parallel=int(opts.get("parallel", 4)),
            transport=_transport(opts.get("transport") or os.environ.get("KVFERRY_TRANSPORT") or "auto"),
        )

    def client_engine(self) -> Engine:
        """A client-only ``kvferry.Engine`` for these options (no listener; a small
        arena and store: the tier and the L2 adapter read into registered L1 memory)."""
        import kvferry

        directory: Any = self.directory
        return kvferry.Engine(
            listen=None,
            secret=self.secret,
            arena_bytes=4 << 20,
            page_size=1 << 20,
            store_bytes=1 << 20,
            store_block_bytes=64 << 10,
            io_timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            transport=self.transport,
            directory=directory,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_ca=self.tls_ca,
        )


def _transport(v: Any) -> str:
    t = str(v)
    if t not in ("auto", "tcp"):
        raise ValueError(f"kvferry.transport (or KVFERRY_TRANSPORT) must be 'auto' or 'tcp', got {t!r}")
    return t
