"""The ``autotp`` console script (also ``python -m autotp.cli``).

Before it imports the CLI (torch and the capture stack: seconds), it reads which command runs: ``shard`` and
``profile`` launch ranks that run one of autotp's functions, so their fork server starts first and imports
the ranks' module on another core while this process imports and checks (:mod:`autotp.distributed.warm`).
Everything else (argument parsing, help, errors) is the typer app's, in :mod:`autotp.cli.main`.
"""
from __future__ import annotations

import sys

# command -> what its ranks import: first the module of the function they run, then what that function
# imports when it runs (the parallel runtime and the capture stack: another second per rank)
RANK_MODULES = {
    "shard": ("autotp.cli.shard_worker", "autotp.parallel.parallelize", "autotp.parallel.pipeline"),
    "profile": ("autotp.layout.profile",),
}


def rank_modules(argv: list[str]) -> tuple[str, ...]:
    """What the ranks of this command line will import; none where it launches no ranks or only asks for
    help."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in RANK_MODULES or "--help" in argv:
        return ()
    return RANK_MODULES[command]


def run() -> None:
    """Warm the ranks of a command that launches them, then run the app."""
    modules = rank_modules(sys.argv[1:])
    if modules:
        from autotp.distributed.warm import warm_ranks

        warm_ranks(modules)
    from autotp.cli.main import run as main

    main()
