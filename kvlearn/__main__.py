"""`python -m kvlearn COMMAND`: the course's command line."""

import sys
from importlib import import_module

# command -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "demo": ("kvlearn.bench.demo", "the real model, decoded with and without a KV cache, then served by the engine"),
    "bench": ("kvlearn.bench.cli", "every cache strategy and the Hugging Face peers on one workload, side by side"),
    "gpu-check": ("kvlearn.bench.gpucheck", "both attention backends on a CUDA GPU against Hugging Face; "
                                            "--dry: the same on the CPU"),
    "check": ("kvlearn.workshop.envcheck", "is this laptop ready for the course? one OK / FAIL line per requirement"),
    "course": ("kvlearn.workshop.course", "run every notebook in a fresh kernel, in order; "
                                          "per-chapter time and result"),
    "route": ("kvlearn.routing.cli", "a trace on a fleet of replicas behind each routing policy, "
                                     "simulated (chapter 7)"),
    "replay": ("kvlearn.routing.replay", "a Mooncake production trace through one prefix cache per capacity: "
                                         "hit rates (chapter 7)"),
    "record": ("kvlearn.workshop.record", "re-execute notebooks in place on a quiet machine, "
                                          "recording the load in their metadata"),
    "student": ("kvlearn.workshop.student", "the learners' copies of the notebooks, in student/: "
                                            "every solution becomes a stub"),
    "mutants": ("kvlearn.workshop.mutants", "mutants of the worked solutions against each part's check: "
                                            "is every one killed?"),
}

USAGE = "usage: python -m kvlearn COMMAND [options]\n\n" + "\n".join(
    f"  {name:<10}{about}" for name, (_, about) in COMMANDS.items()) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
