"""``tools.loadgen`` without a server: what ``scripts/soak.py`` counts as a socket beyond loopback."""

from __future__ import annotations

from tools.loadgen import off_loopback


def test_soak_socket_check_accepts_ipv4_mapped_loopback_and_refuses_the_rest() -> None:
    # Rows as listening_sockets gives them: (address, port, command). soak.py notes len(off_loopback(...)).
    loopback = [("127.0.0.1", 8000, "serve"), ("127.3.2.1", 6379, "gcs_server"), ("::1", 52365, "agent"),
                ("::ffff:127.0.0.1", 8265, "dual-stack socket bound to 127.0.0.1")]
    beyond = [("10.1.2.3", 6379, "gcs_server"), ("0.0.0.0", 8000, "proxy"), ("::", 9000, "grpc"),
              ("::ffff:10.1.2.3", 8001, "dual-stack socket bound to 10.1.2.3")]
    assert off_loopback(loopback) == []
    assert off_loopback(loopback + beyond) == beyond
