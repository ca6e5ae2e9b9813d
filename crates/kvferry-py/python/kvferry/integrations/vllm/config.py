"""The connector's settings: ``kv_connector_extra_config`` read, checked and defaulted
(see the package docs for every key)."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

from .versions import NEWEST, SUPPORTED

_log = logging.getLogger(__name__)

VLLM_VERSION = NEWEST
"""The newest vLLM the connector supports; :data:`VLLM_VERSIONS` lists every one
(:mod:`.versions`)."""

VLLM_VERSIONS: tuple[str, ...] = tuple(SUPPORTED)
"""Every vLLM version the connector supports, newest first (0.32.0: the CPU build)."""

_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "advertise_host": None,
    "timeout": 30.0,
    "lease_ttl": 60.0,
    "secret": None,
    "secret_file": None,
    "path": "direct",
    "io_timeout": 5.0,
    "connect_timeout": 3.0,
    "arena_bytes": 64 << 20,
    "peer_id": None,
    "device": None,
    "device_timeout": None,
    "idle_wait": 0.001,
    "reader_slots": "auto",
    "read_batch": 8,
    "transport": "auto",
}

@dataclass(frozen=True)
class KvferryConfig:
    """The connector's settings, read from ``kv_connector_extra_config`` (see the
    module docstring for each key)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    timeout: float = 30.0
    lease_ttl: float = 60.0
    secret: str | None = None
    path: str = "direct"
    io_timeout: float = 5.0
    connect_timeout: float = 3.0
    arena_bytes: int = 64 << 20
    peer_id: str | None = None
    device: str | None = None
    device_timeout: float | None = None
    idle_wait: float = 0.001
    reader_slots: int | None = None  # None: "auto" (vllm_hetero.auto_reader_slots)
    read_batch: int = 8
    transport: str = "auto"

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> KvferryConfig:
        kvc = vllm_config.kv_transfer_config
        extra = dict(kvc.kv_connector_extra_config or {}) if kvc is not None else {}
        unknown = sorted(set(extra) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"KvferryConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_DEFAULTS)}")
        cfg = cls(
            host=str(extra.get("host", _DEFAULTS["host"])),
            port=int(extra.get("port", _DEFAULTS["port"])),
            advertise_host=extra.get("advertise_host"),
            timeout=float(extra.get("timeout", _DEFAULTS["timeout"])),
            lease_ttl=float(extra.get("lease_ttl", _DEFAULTS["lease_ttl"])),
            secret=_secret(extra.get("secret"), extra.get("secret_file")),
            path=str(extra.get("path", _DEFAULTS["path"])),
            io_timeout=float(extra.get("io_timeout", _DEFAULTS["io_timeout"])),
            connect_timeout=float(extra.get("connect_timeout", _DEFAULTS["connect_timeout"])),
            arena_bytes=int(extra.get("arena_bytes", _DEFAULTS["arena_bytes"])),
            peer_id=extra.get("peer_id"),
            device=extra.get("device"),
            device_timeout=None if extra.get("device_timeout") is None else float(extra["device_timeout"]),
            idle_wait=float(extra.get("idle_wait", _DEFAULTS["idle_wait"])),
            reader_slots=_reader_slots(extra.get("reader_slots", _DEFAULTS["reader_slots"])),
            read_batch=_read_batch(extra.get("read_batch", _DEFAULTS["read_batch"])),
            transport=_transport(extra.get("transport", _DEFAULTS["transport"])),
        )
        for name in ("timeout", "lease_ttl", "io_timeout", "connect_timeout"):
            if not getattr(cfg, name) > 0:
                raise ValueError(f"KvferryConnector: {name} must be > 0, got {getattr(cfg, name)!r}")
        if cfg.device not in (None, "sim"):
            raise ValueError(f"KvferryConnector: device must be 'sim' or unset (the KV tensors' own device), got {cfg.device!r}")
        if cfg.device_timeout is not None and not cfg.device_timeout > 0:
            raise ValueError(f"KvferryConnector: device_timeout must be > 0, got {cfg.device_timeout!r}")
        if not 0 <= cfg.idle_wait <= 0.1:
            raise ValueError(f"KvferryConnector: idle_wait must be between 0 and 0.1 seconds, got {cfg.idle_wait!r}")
        if cfg.path not in ("direct", "staged"):
            raise ValueError(f"KvferryConnector: path must be 'direct' or 'staged', got {cfg.path!r}")
        if not 0 <= cfg.port < 65536:
            raise ValueError(f"KvferryConnector: port out of range: {cfg.port}")
        if cfg.secret is None and not _loopback(cfg.host):
            _log.warning(
                "KvferryConnector: the kvferry engine listens on %s without a shared secret: whoever reaches "
                "that port may read published KV; set secret_file (or secret) on every instance (docs/security.md)",
                cfg.host,
            )
        return cfg

def _loopback(host: str) -> bool:
    """``host`` names the loopback interface only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _secret(secret: Any, secret_file: Any) -> str | None:
    """The shared secret: ``secret`` as given, or the content of ``secret_file`` stripped
    of surrounding whitespace (as ``kvferry serve --secret-file`` reads it), so that the
    secret stays out of the command line; both set is refused."""
    if secret_file is None:
        return None if secret is None else str(secret)
    if secret is not None:
        raise ValueError("KvferryConnector: set secret or secret_file, not both")
    try:
        text = open(str(secret_file), encoding="utf-8").read().strip()
    except OSError as e:
        raise ValueError(f"KvferryConnector: cannot read secret_file {secret_file!r}: {e.strerror or e}") from None
    if not text:
        raise ValueError(f"KvferryConnector: secret_file {secret_file!r} is empty")
    return text


def _transport(v: Any) -> str:
    if v not in ("auto", "tcp"):
        raise ValueError(f"KvferryConnector: transport must be 'auto' or 'tcp', got {v!r}")
    return str(v)


def _read_batch(v: Any) -> int:
    """``read_batch`` from the config: an int in 1..64."""
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
        raise ValueError(f"KvferryConnector: read_batch must be an int in 1..64 (1: one get per request), got {v!r}")
    return v

def _reader_slots(v: Any) -> int | None:
    """``reader_slots`` from the config: None for ``"auto"``, else an int in 1..64."""
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}") from None
    if not 1 <= n <= 64:
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}")
    return n

# -- messages between the two halves -----------------------------------------------
