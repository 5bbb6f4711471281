"""The ``autotp`` console script (also ``python -m autotp.cli``).

Before it imports the CLI, it reads which command runs: ``shard`` and ``profile`` launch ranks that run one of
autotp's functions, so the command is handed the modules their fork server preloads; it starts the server once
its checks that need no torch have passed, and the server imports the ranks' modules on another core while the
command imports torch and checks the model (:mod:`autotp.distributed.warm`). Started before those checks, the
server's import of torch would compete with them for the cores: a mistyped path took 3.5-5 s to be said on
2 busy cores instead of 1.5 s. Everything else (argument parsing, help, errors) is the typer app's, in
:mod:`autotp.cli.main`.
"""
from __future__ import annotations

import sys

# command -> what its ranks import: first the module of the function they run, then what that function
# imports when it runs (the parallel runtime and the capture stack: another second per rank)
RANK_MODULES = {
    "shard": ("autotp.cli.shard_worker", "autotp.parallel.parallelize", "autotp.parallel.pipeline"),
    "profile": ("autotp.search.profile",),
}


def rank_modules(argv: list[str]) -> tuple[str, ...]:
    """What the ranks of this command line will import; none where it launches no ranks or only asks for
    help."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in RANK_MODULES or "--help" in argv:
        return ()
    return RANK_MODULES[command]


def run() -> None:
    """Run the app, handing a command that launches ranks the modules to warm them with."""
    from autotp.cli.main import run as main

    main(warm=rank_modules(sys.argv[1:]))
