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


# the rank-launching tests run in this many streams side by side, each one xdist worker's (pyproject.toml)
SLOW_STREAMS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``pyproject.toml``'s ``-n 3 --dist loadgroup``) the ``slow`` tests run in two streams,
    each one worker's, the third worker running the unit and structural tiers beside them. A module's slow
    tests stay in one stream, in collection order, so its batched launch (:class:`ranks.Launches`) stays one
    launch. The modules are dealt to the streams heaviest first, by the seconds the last suite profile
    measured (``benchmarks/results/suite_profile.json``; a module it lacks counts as its median). Two streams,
    not one: a stream alone leaves about a quarter of 2 cores idle (process starts, imports, rendezvous,
    rank 0's checkpoint writes, a launcher waiting for its command), which the other stream's ranks use.
    The slow tests come first, so that each stream starts at once. Before xdist's own hook, which reads the
    group."""
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if not slow:
        return
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in slow))
    stream = _deal(files, _measured_seconds(), SLOW_STREAMS)
    for item in slow:
        item.add_marker(pytest.mark.xdist_group(f"ranks-{stream[item.nodeid.split('::')[0]]}"))
    ranked = set(map(id, slow))
    items[:] = slow + [item for item in items if id(item) not in ranked]


def _measured_seconds() -> dict[str, float]:
    import json

    try:
        with open(os.path.join(ROOT, "benchmarks", "results", "suite_profile.json")) as f:
            return {str(k): float(v) for k, v in dict(json.load(f)["per_file"]).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _deal(files: list[str], seconds: dict[str, float], streams: int) -> dict[str, int]:
    """Each file's stream: heaviest first, to the stream with the fewest seconds so far."""
    known = sorted(seconds.get(f, 0.0) for f in files if f in seconds)
    default = known[len(known) // 2] if known else 1.0
    load = [0.0] * streams
    out = {}
    for f in sorted(files, key=lambda f: -seconds.get(f, default)):
        out[f] = min(range(streams), key=lambda i: load[i])
        load[out[f]] += seconds.get(f, default)
    return out
