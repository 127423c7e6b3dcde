#!/usr/bin/env python3
"""Make the CA and node certificate for Ray's TLS between a cluster's hosts.  (`tools.tls_certs`; options: --help)"""

from tools.tls_certs import main

if __name__ == "__main__":
    raise SystemExit(main())
