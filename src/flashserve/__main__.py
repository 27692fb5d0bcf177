"""Entry point: `flashserve serve [options]`, `flashserve run-batch -i IN -o OUT [options]` (or
`python -m flashserve ...`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from flashserve.cli import build_parser
    from flashserve.serve_args import to_batch_args, to_configs

    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:  # options that do not go together: the parser's error and exit status 2, before anything starts
        args = to_configs(ns) if ns.command == "serve" else to_batch_args(ns)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.command == "serve":
        from flashserve.entrypoints.serve import main as serve

        return serve(args)
    elif ns.command == "run-batch":
        from flashserve.entrypoints.run_batch.main import main as run_batch

        return run_batch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
