"""Certificates for Ray's TLS (``RAY_USE_TLS=1``): a cluster CA and one node certificate signed by it.

Ray's gRPC TLS is mutual: every process presents ``RAY_TLS_SERVER_CERT`` as both server and client, and
accepts only peers signed by ``RAY_TLS_CA_CERT``. One node certificate whose subject alternative names list
every node's address (and loopback, which Ray's processes also dial) serves the whole cluster, so the
launcher can copy the same three files to every node; the CA's key stays with the operator.

    python scripts/make_tls_certs.py DIR 10.0.0.10 10.0.0.11 ...   # DIR/ca.crt, node.crt, node.key

Uses the ``openssl`` command line (present wherever Ray's launcher runs: it ships with OpenSSH's systems).
"""

from __future__ import annotations

import argparse
import ipaddress
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

FILES = ("ca.crt", "node.crt", "node.key")  # what a node needs; ca.key stays where it was made
DAYS = 825  # the longest validity common TLS clients accept for a leaf certificate
NEW_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")  # P-256, unencrypted


def make_certs(out: Path, addresses: Sequence[str], *, name: str = "specserve") -> dict[str, Path]:
    """Write ``ca.key``/``ca.crt`` and ``node.key``/``node.crt`` (SANs: ``addresses``, 127.0.0.1,
    localhost) under ``out`` (0700, keys 0600); return the paths of ``FILES`` by name."""
    ips = [str(ipaddress.ip_address(a)) for a in addresses]  # ValueError on anything but an address
    if (out / "ca.key").exists():  # a new CA would lock every node holding the old certificates out
        raise FileExistsError(f"{out / 'ca.key'} exists: remove {out} to make new certificates")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    ca_key, ca_crt, key, crt = (out / f for f in ("ca.key", "ca.crt", "node.key", "node.crt"))
    _openssl("req", "-x509", *NEW_KEY, "-keyout", ca_key, "-out", ca_crt, "-days", DAYS,
             "-subj", f"/CN={name} Ray CA")
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "node.csr", Path(tmp) / "san.ext"
        _openssl("req", *NEW_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={name} Ray node")
        sans = ",".join([*(f"IP:{ip}" for ip in dict.fromkeys([*ips, "127.0.0.1"])), "DNS:localhost"])
        ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
                 "-out", crt, "-days", DAYS, "-extfile", ext)
    for k in (ca_key, key):
        k.chmod(0o600)
    (out / "ca.srl").unlink(missing_ok=True)
    return {f: out / f for f in FILES}


def _openssl(*argv: object) -> None:
    done = subprocess.run(["openssl", *map(str, argv)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {argv[0]} failed: {done.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write ca.key, ca.crt, node.key, node.crt into")
    parser.add_argument("addresses", nargs="+", help="every node's address (the head's and the workers')")
    args = parser.parse_args(argv)
    try:
        paths = make_certs(args.out.expanduser(), args.addresses)
    except (ValueError, RuntimeError, FileExistsError) as e:
        parser.error(str(e))
    print("\n".join(str(p) for p in paths.values()))
    print(f"keep {args.out / 'ca.key'} off the cluster: it signs new node certificates")
    return 0
