#!/usr/bin/env python3
"""A host lab on this machine: network-namespace "hosts" with their own address and sshd (`tools.hostlab`;
docs/platform.md#host-lab). Needs root. Options: --help.

  up N      create N hosts, print them and how to ssh in; stays up until Ctrl-C (or SIGTERM), then tears down
  down      remove what a killed lab left behind (refuses while a lab with the prefix runs, unless --force)
  status    what exists with the prefix, and which process holds the live lab
"""

from __future__ import annotations

import argparse
import signal

from tools import hostlab


def up(args) -> int:
    # Ctrl-C, SIGTERM and SIGHUP all raise KeyboardInterrupt (SIGINT too where a shell started us with it
    # ignored, as `&` does), which unwinds through the `with`: that tears the lab down.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    with hostlab.HostLab(args.n, prefix=args.prefix, net=args.net) as lab:
        for host in lab.hosts:
            print(f"{host.name}  {host.address}")
        print(f"ssh:  ssh -F {lab.config_file} {lab.hosts[0].name} hostname -I")
        print(f"key:  {lab.key_file} (user root); this machine is {lab.gateway} on the lab's bridge")
        print("ready; Ctrl-C tears the lab down", flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            # A second signal (Ctrl-C twice, or a wrapper such as `timeout` passing one on) must not cut the
            # teardown short and leave namespaces behind.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
    print("torn down")
    return 0


def down(args) -> int:
    if (pid := hostlab.lock_holder(args.prefix)) and not args.force:
        print(f"a {args.prefix} lab is running (pid {pid}): stop it with Ctrl-C, or pass --force")
        return 1
    removed = hostlab.cleanup_stale(args.prefix)
    print("\n".join(removed) if removed else f"nothing carries the prefix {args.prefix}")
    return 0


def status(args) -> int:
    pid = hostlab.lock_holder(args.prefix)
    print(f"live lab: pid {pid}" if pid else "live lab: none")
    for ns in hostlab.lab_namespaces(args.prefix):
        print(f"netns {ns}: pids {' '.join(map(str, hostlab.netns_pids(ns))) or '-'}")
    for link in hostlab.lab_links(args.prefix):
        print(f"link {link}")
    for d in hostlab.lab_dirs(args.prefix):
        print(f"dir {d}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=hostlab.PREFIX,
                        help="starts the name of everything the lab makes (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create N hosts and keep them until Ctrl-C")
    p_up.add_argument("n", type=int)
    p_up.add_argument("--net", type=int, default=0, help="the lab subnet is 198.18.NET.0/24 (default %(default)s)")
    p_up.set_defaults(run=up)
    p_down = sub.add_parser("down", help="remove a killed lab's leftovers")
    p_down.add_argument("--force", action="store_true", help="also tear down a running lab")
    p_down.set_defaults(run=down)
    sub.add_parser("status", help="what exists with the prefix").set_defaults(run=status)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
