from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests", "support")):
    if p not in sys.path:
        sys.path.insert(0, p)


import multiprocessing.process  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    """The plan cache off, in a folder of the session's own, from the start: the fork server the ranks fork
    from starts before any test's fixtures run and keeps this environment (so do module-scoped launches)."""
    os.environ["AUTOTP_PLAN_CACHE"] = "0"
    os.environ["AUTOTP_CACHE_DIR"] = config._autotp_plans = tempfile.mkdtemp(prefix="autotp-plan-cache-")


def pytest_unconfigure(config):
    shutil.rmtree(config._autotp_plans, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked ``slow`` belongs to the unit or structural tier: neither it nor its fixtures may
    launch ranks or other processes, so that ``pytest -m "not slow"`` stays fast."""
    if item.get_closest_marker("slow") is not None:
        # ranks fork from the session's fork server, those an in-process `autotp shard` launches too, as the
        # console script's do from its own (tests/support/ranks.py)
        from ranks import start_fork_server

        start_fork_server()
        yield
        return

    def refuse(*args, **kwargs):
        pytest.fail(f"{item.nodeid} starts a process: mark it @pytest.mark.slow", pytrace=False)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        mp.setattr(subprocess.Popen, "__init__", refuse)
        yield


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory, monkeypatch):
    """Each test plans into a cache folder of its own: none reads another's plans or the user's. Ranks fork
    from a server that keeps the first launch's environment, so ranks of later tests would share a folder:
    ``parallelize`` does not use the cache in tests (whether a rank hit would depend on which test ran
    first), except where a test turns it on for its ranks (tests/support/reuse_workers.py)."""
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))
    monkeypatch.setenv("AUTOTP_PLAN_CACHE", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Two things, before xdist's own hook reads the groups:

    - ``extended`` tests (the rest of a matrix whose core the default run covers: more spellings at tp 4,
      more schedules, more fault points) run only when ``-m`` names them (``pytest -m extended``);
    - under pytest-xdist (``pyproject.toml``'s ``-n 2 --dist loadgroup``) the rank-launching tests of a module
      form one group, which one worker runs in order, so a module's batched launch (:class:`ranks.Launches`)
      stays one launch. Groups of different modules run on both workers: a launch leaves its cores idle
      part of the time (process starts, rendezvous, rank 0's checkpoint writes, waits on a peer), which the
      other worker's launch uses. The modules whose tests time how a failure is handled
      (timeouts, restarts, a killed rank) share one group, so they never overlap each other."""
    if "extended" not in (config.getoption("markexpr") or ""):
        extended = [item for item in items if item.get_closest_marker("extended") is not None]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if item.get_closest_marker("extended") is None]
    for item in items:
        if item.get_closest_marker("slow") is not None:
            module = item.module.__name__.rsplit(".", 1)[-1]
            item.add_marker(pytest.mark.xdist_group("ranks-timed" if module in TIMED else f"ranks-{module}"))
    # the rank-launching groups first, the fast tier (a fraction of a second a test) after them: whichever
    # worker finishes its groups first takes the fast tier, so neither waits on the other at the end
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# modules whose tests bound a failure's handling in time (a hang's timeout, a restart, a killed rank's exit)
TIMED = {"test_reliability", "test_faults", "test_ckpt_retention", "test_warm_ranks", "test_cpu_binding"}
