"""The command line's arguments: ``doctor``, ``bench``, ``--version``.

>>> main(["doctor"])              # what ``python -m autograph doctor`` runs
"""

from __future__ import annotations

import argparse

from ._doctor import doctor, versions

# Plain text, not the docstring: argparse prints it as it is, where reST markup would show.
DESCRIPTION = """\
autograph: automatic CUDA graphs for PyTorch. These commands check this machine and show what
graphs change on it.

commands:
  doctor   versions of autograph, torch, Python and CUDA; the GPU; whether a test
           function is captured into a CUDA graph and replayed here.
             example: python -m autograph doctor
  bench    a 32-layer MLP at batch 1: eager, a hand-written CUDA graph and
           autograph.graphed, timed side by side. Without a GPU it shows that the
           calls ran eagerly and why, and how eager and autograph compare on the CPU.
             example: python -m autograph bench

Each command has its own --help: python -m autograph doctor --help.
"""


DOCTOR = """\
Checks this machine for autograph: the versions of autograph, torch, Python and CUDA, the
GPU, and whether a test function is captured into a CUDA graph and replayed here. On a CPU
build of torch (or with no GPU visible) it says that every graphed call runs eagerly, and how
to run graphed code on the CPU anyway: autograph.testing.emulate_graphs_on_cpu().

  example: python -m autograph doctor
"""

BENCH = """\
Times a 32-layer MLP at batch 1 three ways, side by side: eager, a hand-written CUDA graph
and autograph.graphed, then prints autograph.report(). Without a GPU it shows that the calls
ran eagerly and why, and autograph's own cost on that path, with the spread between rounds
that says which differences this machine can measure.

  example: python -m autograph bench
"""


def main(argv: list | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m autograph",
        description=DESCRIPTION,
        usage="python -m autograph [doctor | bench] [--version]",
        formatter_class=raw,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=versions(),
        help="print the versions of autograph, torch and Python, and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", help=argparse.SUPPRESS)
    for name, text in (("doctor", DOCTOR), ("bench", BENCH)):
        commands.add_parser(
            name,
            prog=f"python -m autograph {name}",
            description=text,
            usage=f"python -m autograph {name}",
            formatter_class=raw,
        )
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "doctor":
        return doctor()
    from ._demo import demo

    demo()
    return 0
