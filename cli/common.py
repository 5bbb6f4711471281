"""What the commands share: the usage-error exit code and the one-line error printer."""
from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

# Exit code for a bad combination of sizes, the same one click uses for usage errors.
USAGE_ERROR = 2


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print a one-line red error to stderr and exit with ``code``."""
    # soft_wrap keeps the message on one line whatever the terminal width.
    Console(stderr=True).print(
        f"[bold red]error:[/bold red] [red]{escape(message)}[/red]", soft_wrap=True
    )
    raise typer.Exit(code=code)
