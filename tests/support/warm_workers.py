"""What a rank of tests/cli/test_warm_ranks.py reports about how it started."""
from __future__ import annotations

import os
import sys

import torch

from autotp.distributed.job import job_from_env


def report() -> dict:
    """Its parent, the launcher's variables and threads as it sees them, and whether the parallel runtime was
    imported before it ran (by the fork server's preload)."""
    return {"ppid": os.getppid(), "rank": os.environ["RANK"], "tp": job_from_env().grid.tp,
            "progress": os.environ.get("AUTOTP_PROGRESS_DIR"), "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(), "cwd": os.getcwd(), "late": os.environ.get("WARM_LATE"),
            "early": os.environ.get("WARM_EARLY"),
            "preloaded": "autotp.parallel.parallelize" in sys.modules}
