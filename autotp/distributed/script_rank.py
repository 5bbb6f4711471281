"""One rank of ``autotp run``: the user's script run as ``python SCRIPT ARGS`` would run it, with the exception
that ends it recorded in torch's error file (as torch's ``@record`` does), so the launcher names the rank that
raised and its message instead of guessing from exit codes and signals (a rank that raised exits with 1 a
moment after its peers were stopped with SIGTERM because of it).

``python -m autotp.distributed.script_rank SCRIPT [ARGS...]``
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts the script's folder first
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        runpy.run_path(script, run_name="__main__")
        return
    from torch.distributed.elastic.multiprocessing.errors import record

    record(lambda: runpy.run_path(script, run_name="__main__"))()


if __name__ == "__main__":
    main()
