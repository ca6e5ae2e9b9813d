"""Test certificates made with the openssl command: a CA and node certificates valid
for 127.0.0.1 and localhost (what kvferry's mutual TLS verifies). Shared by the TLS
tests of the Python engine and of the LMCache tier."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key) PEM files in ``d``."""
    key, crt = d / f"{name}.key", d / f"{name}.pem"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
         "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(crt),
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return crt, key


def make_node(d: Path, ca: tuple[Path, Path], cn: str) -> tuple[Path, Path]:
    """A node certificate signed by ``ca``: (certificate, key) PEM files in ``d``."""
    key, csr, crt, ext = d / f"{cn}.key", d / f"{cn}.csr", d / f"{cn}.pem", d / f"{cn}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={cn}",
         "-keyout", str(key), "-out", str(csr))
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-days", "2", "-out", str(crt), "-extfile", str(ext))
    return crt, key


def make_pki(d: Path, nodes: dict[str, str]) -> dict[str, Path]:
    """CAs ``ca`` and ``other_ca`` and, for each ``{cn: signer}`` (``"ca"`` or
    ``"other_ca"``), ``{cn}_cert`` and ``{cn}_key``."""
    cas = {"ca": make_ca(d, "ca"), "other_ca": make_ca(d, "other-ca")}
    out: dict[str, Path] = {name: pair[0] for name, pair in cas.items()}
    for cn, signer in nodes.items():
        out[f"{cn}_cert"], out[f"{cn}_key"] = make_node(d, cas[signer], cn)
    return out
