"""tools.tls_certs with the real ``openssl``: a node certificate the CA verifies, for every address given and
loopback, usable as server and client (Ray's TLS is mutual), keys private, and no silent new CA."""

from __future__ import annotations

import subprocess

import pytest

from tools.tls_certs import FILES, main, make_certs


def _openssl(*argv: str) -> str:
    return subprocess.run(["openssl", *argv], capture_output=True, text=True, check=True).stdout


def test_node_certificate_is_signed_by_the_ca_for_every_address(tmp_path) -> None:
    paths = make_certs(tmp_path / "tls", ["10.0.0.10", "10.0.0.11", "fd00::1"])
    assert sorted(paths) == sorted(FILES)
    assert "OK" in _openssl("verify", "-CAfile", str(paths["ca.crt"]), str(paths["node.crt"]))
    text = _openssl("x509", "-in", str(paths["node.crt"]), "-noout", "-text")
    for san in ("IP Address:10.0.0.10", "IP Address:10.0.0.11", "IP Address:FD00:0:0:0:0:0:0:1",
                "IP Address:127.0.0.1", "DNS:localhost", "TLS Web Server Authentication",
                "TLS Web Client Authentication"):
        assert san in text, san
    # The node key belongs to the certificate; both keys are the owner's only.
    pub = _openssl("pkey", "-in", str(paths["node.key"]), "-pubout")
    assert pub == _openssl("x509", "-in", str(paths["node.crt"]), "-noout", "-pubkey")
    for key in ("ca.key", "node.key"):
        assert (tmp_path / "tls" / key).stat().st_mode & 0o077 == 0, key
    assert (tmp_path / "tls").stat().st_mode & 0o077 == 0


def test_an_existing_ca_is_never_replaced(tmp_path) -> None:
    make_certs(tmp_path, ["10.0.0.10"])
    before = (tmp_path / "ca.crt").read_bytes()
    with pytest.raises(FileExistsError, match="remove"):
        make_certs(tmp_path, ["10.0.0.10"])
    assert (tmp_path / "ca.crt").read_bytes() == before


@pytest.mark.parametrize("argv, message", [(["10.0.0.300"], "does not appear to be an IPv4 or IPv6 address"),
                                           (["node-1.example"], "does not appear to be an IPv4 or IPv6 address")])
def test_the_script_names_a_bad_address(tmp_path, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "tls"), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "tls").exists()
