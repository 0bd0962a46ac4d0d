"""python -m zero_ext.coordinator --port PORT: the coordinator of replicas
that survive each other's failures (wrap(..., replicas=zero_ext.Replicas(
coordinator="HOST:PORT", replica_id=...)); docs/faults.md). A process of its
own, started by the user or the launcher before the replicas; no replica's
failure takes it down. It serves quorums on PORT and the store the
replicas' cross-replica groups meet through on --store-port (PORT + 1 by
default; any free port if that one is taken: its answers say which)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.coordinator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="quorums on PORT")
    parser.add_argument("--store-port", type=int, default=None,
                        help="the store the replicas' groups meet through (default PORT + 1; a free one if taken)")
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="replicas the first quorum waits for (later ones join the training replicas)")
    parser.add_argument("--dead-after", type=float, default=5.0,
                        help="seconds without a replica's heartbeat before the others go on without it")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65535:
        parser.error(f"--port must be in 1..65534, got {args.port}")
    store_port = args.store_port if args.store_port is not None else args.port + 1
    if args.min_replicas < 1 or args.dead_after <= 0:
        parser.error("--min-replicas must be >= 1 and --dead-after > 0")
    from zero_ext.groups import serve_coordinator

    def ready(server) -> None:
        print(f"zero_ext coordinator: quorums on {args.host}:{args.port}, store on "
              f"{args.host}:{server.coordinator.store_port} (incarnation {server.coordinator.incarnation})", flush=True)

    try:
        serve_coordinator(args.host, args.port, store_port, args.min_replicas, args.dead_after, ready)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
