"""``python -m autotp.cli``: the ``autotp`` command."""
from __future__ import annotations

if __name__ == "__main__":
    from autotp.cli.entry import run

    run()
