"""Entry point: `flashserve serve [options]`, `flashserve run-batch -i IN -o OUT [options]` (or
`python -m flashserve ...`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from flashserve.cli import build_parser, to_batch_args, to_configs

    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "serve":
        from flashserve.entrypoints.serve import main as serve

        return serve(to_configs(ns))
    elif ns.command == "run-batch":
        from flashserve.entrypoints.run_batch.main import main as run_batch

        return run_batch(to_batch_args(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
