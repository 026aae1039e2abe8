"""Fixtures shared by ``tests/`` and ``integration/``."""

from __future__ import annotations

import collections
import os
import resource
import signal
import tempfile
import threading
from collections.abc import Iterator

import pytest
from hypothesis import settings

# No hypothesis deadlines anywhere: how long one example takes says nothing about its correctness,
# and a busy machine (or the first example's imports) made a quick one fail (DeadlineExceeded).
# A test's own @settings(...) inherits this, so a test that forgets deadline=None is covered too.
settings.register_profile("loader", deadline=None)
settings.load_profile("loader")


@pytest.fixture(autouse=True, scope="session")
def aws_profiles_of_our_own() -> Iterator[None]:
    """Keep the developer's ``~/.aws`` and any cloud metadata service out of every test.

    The credential chain reads the shared credentials and config files and, last, asks the
    instance metadata service, whose address is not on this machine. Tests (and the servers and
    CLIs they start, which inherit the environment) see empty profile files in a temporary
    directory and the metadata service switched off, as a user off EC2 would set it. Tests that
    need a profile or the metadata lookup set these variables themselves.
    """
    with tempfile.TemporaryDirectory(prefix="aws-profiles-") as home, pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, "credentials"))
        mp.setenv("AWS_CONFIG_FILE", os.path.join(home, "config"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(autouse=True)
def processes_end_with_their_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Processes a test started through ``multiprocessing`` (DataLoader workers, ranks) end in that
    test's teardown; a test whose processes outlive every reference it dropped is named.

    A DataLoader iterator dropped unfinished (a ``pytest.raises`` keeps one in a reference cycle
    through the error's traceback) runs its workers until a garbage collection finalizes it,
    wherever that collection happens to run: once it ran in a later test's server thread, whose
    start then waited on torch ending the workers (5 s each after a worker's error) and failed
    its own 10 s bound. So the collection runs here.
    """
    import multiprocessing

    before = set(multiprocessing.active_children())
    yield
    if not set(multiprocessing.active_children()) - before:
        return
    import gc
    import warnings

    gc.collect()
    left = set(multiprocessing.active_children()) - before
    for process in left:  # the collection may have just signalled them (torch ends its workers so)
        process.join(timeout=2)
    left = {process.name for process in left if process.is_alive()}
    if left:
        warnings.warn(f"{request.node.nodeid} left processes running after a garbage collection: "
                      f"{sorted(left)}", stacklevel=1)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the test.

    A process started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python then installs no handler of its own: a test that sends itself SIGINT would see
    nothing happen. This puts Python's default handler in place and restores what was there.
    """
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread of ours running after it returns."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in leaked:
        thread.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Lower the floor of ``part_size`` (1 MiB for users) to 1 KiB for this test, so that test
    shards of a few KiB are read as many ranged parts; returns the floor in force."""
    from loader.formats import shards

    monkeypatch.setattr(shards, "MIN_PART_SIZE", 1024)
    return shards.MIN_PART_SIZE


# One interpreter for many probes of what a process imports: it runs the code every case shares
# once, then forks a child per case, so each case starts from a process that holds exactly that
# shared state (as a fresh interpreter would after the same lines) without importing torch again
# (about 3 s of CPU per interpreter). A case's stdout comes back, its stderr and exit status too.
_FORKING_RUNNER = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
shared = {"__name__": "__main__"}
exec(job["setup"], shared)
results = {}
for number, (name, code) in enumerate(job["cases"].items()):
    sys.stdout.flush(); sys.stderr.flush()
    errors = os.path.join(job["scratch"], f"{number}.err")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            exec(code, dict(shared))
            status = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    _, wait_status = os.waitpid(pid, 0)
    with open(errors, "rb") as err:
        results[name] = [os.waitstatus_to_exitcode(wait_status), out.decode(errors="replace"),
                         err.read().decode(errors="replace")]
print(json.dumps(results))
"""


def _run_forked_probes(setup: str, cases: dict[str, str], env: dict[str, str] | None = None,
                       timeout: float = 300) -> dict[str, tuple[int, str, str]]:
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as scratch:
        job = json.dumps({"setup": setup, "cases": cases, "scratch": scratch})
        run = subprocess.run([sys.executable, "-c", _FORKING_RUNNER], input=job, capture_output=True, text=True,
                             env=env, timeout=timeout, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return {name: (code, out, err) for name, (code, out, err) in json.loads(run.stdout.splitlines()[-1]).items()}


@pytest.fixture(scope="session")
def forked_probes():
    """``forked_probes(setup, {name: code}, env=None)`` -> ``{name: (exit code, stdout, stderr)}``:
    one fresh interpreter runs ``setup`` (only what every case shares: their common imports),
    then each case's code in a child forked from it, one after the other."""
    return _run_forked_probes


# ---------------------------------------------------------------- where the suite's CPU goes
# The suite is bound by CPU on a 2-core machine (its wall time follows user + system seconds), so
# every run ends with the files that spent the most: each test's CPU is its process's plus that
# of the processes it started and waited for (spawned ranks and workers, CLIs, servers it
# restarted), sent with the test's last report, so that xdist's workers report to the main
# process. A server started once per worker is counted where it stops: in that worker's last test.
_CPU_AT_START = pytest.StashKey[float]()
_CPU_BY_FILE: collections.Counter[str] = collections.Counter()
_CPU_SHOWN = 12


def _cpu_seconds() -> float:
    """User + system seconds of this process and of the children it has waited for."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        outcome.get_result().user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_AT_START]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _CPU_BY_FILE[report.nodeid.split("::", 1)[0]] += value


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    total = sum(_CPU_BY_FILE.values())
    if total <= 0 or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.section(f"CPU: {total:,.0f} s (user + system), the {_CPU_SHOWN} files that spent the most")
    for path, seconds in _CPU_BY_FILE.most_common(_CPU_SHOWN):
        terminalreporter.write_line(f"{seconds:7.1f} s {seconds / total:6.1%}  {path}")
