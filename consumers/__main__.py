"""python -m consumers serve <verifier|credit|batcher|trainer> [...] | status"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from consumers import services, status

    parser = argparse.ArgumentParser(prog="python -m consumers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    services.add_args(sub.add_parser("serve", help="run one service"))
    status.add_args(sub.add_parser("status", help="per-service consumer lag and throughput"))
    args = parser.parse_args(argv)
    return services.cmd_serve(args) if args.cmd == "serve" else status.cmd_status(args)


if __name__ == "__main__":
    sys.exit(main())
