"""A second "host" for the real-serving suite: a network namespace joined to this one by
a veth pair, optionally rate-limited with ``tbf`` (so the link, not the CPU, limits a
transfer, as between machines).

``OtherHost`` makes the namespace ``kvf-serve-<pid>-<n>`` with ``lo`` up and ``eth0`` at
``10.78.<k>.2/30``; this namespace's end of the pair is ``kvfs<pid>n<n>`` at
``10.78.<k>.1``. A process started through :meth:`OtherHost.wrap` runs in that network
namespace *and* in a PID namespace of its own (``unshare --pid --fork --kill-child``):
another machine's pids mean nothing here, so kvferry's same-host probe (it reads the
producer's memory by pid) fails and the socket carries the KV, exactly as between two
machines. ``close()`` (and interpreter exit) kills what is left in the namespace and
deletes it, which removes the pair. Needs root and ``ip``/``tc``/``unshare``;
:func:`missing` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from dataclasses import dataclass

_made: list[OtherHost] = []
_count = 0


def missing() -> str | None:
    """Why this process cannot make a namespace host, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    return None


def _run(*argv: str) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


@dataclass
class OtherHost:
    """A network namespace standing for another machine; see the module docs."""

    ns: str
    ip: str
    """This host's address, as the other side reaches it."""
    peer_ip: str
    """This process's address on the pair, as the namespace reaches it."""
    veth: str
    """This namespace's end of the pair (its counters: the bytes that crossed)."""

    @classmethod
    def make(cls, rate_mbit: float | None = None) -> OtherHost:
        """The namespace and its link; with ``rate_mbit``, both directions limited by ``tbf``."""
        global _count
        _count += 1
        n = _count
        k = (os.getpid() * 7 + n) % 250 + 1
        h = cls(f"kvf-serve-{os.getpid()}-{n}", f"10.78.{k}.2", f"10.78.{k}.1", f"kvfs{os.getpid() % 100000}n{n}")
        _made.append(h)
        try:
            _run("ip", "netns", "add", h.ns)
            _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _run("ip", "addr", "add", f"{h.peer_ip}/30", "dev", h.veth)
            _run("ip", "link", "set", h.veth, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.ip}/30", "dev", "eth0")
            _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
            if rate_mbit is not None:
                h.limit(rate_mbit)
        except BaseException:
            h.close()
            raise
        return h

    def limit(self, rate_mbit: float) -> None:
        """Both directions at ``rate_mbit`` (``tbf``, a 64 KiB burst, 50 ms of queue)."""
        args = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "50ms"]
        _run("tc", "qdisc", "replace", "dev", self.veth, "root", *args)
        _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *args)

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host: its network namespace and a PID namespace of its own."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--pid", "--fork", "--kill-child", *argv]

    def received_bytes(self) -> int:
        """Bytes this process's namespace received from this host over the pair."""
        with open(f"/sys/class/net/{self.veth}/statistics/rx_bytes") as f:
            return int(f.read())

    def close(self) -> None:
        """Kill what runs inside and delete the namespace (and the pair); never raises."""
        try:
            pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=10).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self in _made:
            _made.remove(self)


@atexit.register
def _close_all() -> None:
    for h in list(_made):
        h.close()
