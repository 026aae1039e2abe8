"""The harness: server, data, latency proxies, and one child process per loader, one at a time.

Only this process starts servers and proxies; measurements happen in ``bench.child`` processes so
that one loader's threads, native runtimes (obstore's tokio, the AWS CRT) or a crash cannot leak
into the next. Within a child, runs with DataLoader workers come first and ``num_workers=0`` runs
last, so no child forks after iterating in its main process (obstore refuses that, see
``loader/s3/obstore_store.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loader.tools.examples import put_all as upload

from .child import RESULT, START
from .loaders import LOADERS

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CHILD_START_ALLOWANCE = 120.0  # imports + first worker fork on a busy 2-core machine
HANG_ALLOWANCE = 45.0  # seconds without any sign of progress from a child that count as a hang
FULL_EPOCH_LIMIT = 60.0  # safety cap on the epochs of loaders that are never capped (see child.py)
# what a child must not inherit: other endpoints, profiles and backend overrides
_ENV_DROP = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE",
             "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE", "MINIO_ENDPOINT", "MINIO_ACCESS_KEY",
             "MINIO_SECRET_KEY", "MINIO_SECURE", "LOADER_STORE", "AWS_CA_BUNDLE")


@dataclasses.dataclass
class Options:
    samples: int = 2000
    decode_samples: int = 512  # the decode workload reads a copy of the first N samples
    shards: int = 8
    workers: tuple[int, ...] = (0, 2, 4)
    latencies: tuple[float, ...] = (0.0, 0.02)
    workloads: tuple[str, ...] = ("raw", "decode")
    loaders: tuple[str, ...] = tuple(LOADERS)
    epochs: int = 2
    warmup_seconds: float = 2.0
    epoch_seconds: float = 3.0
    quick: bool = False
    images: str = "synthetic"  # bench.data.IMAGES: "photo" for the decode section
    out_dir: Path = RESULTS_DIR
    log_path: Path | None = None


def select_loaders(patterns: str | None, peers: bool, names: tuple[str, ...] = tuple(LOADERS)) -> tuple[str, ...]:
    """``--only``: comma-separated substrings or globs of loader names; ``--no-peers`` drops peers."""
    chosen = list(names)
    if patterns:
        wanted = [p.strip() for p in patterns.split(",") if p.strip()]
        chosen = [n for n in chosen if any(fnmatch.fnmatch(n, p) or p in n for p in wanted)]
    if not peers:
        chosen = [n for n in chosen if LOADERS[n].family != "peer"]
    return tuple(chosen)


def plan_runs(options: Options) -> list[list[dict[str, Any]]]:
    """Runs grouped by loader (one child each); in a group, worker runs first, ``w=0`` last."""
    groups = []
    for name in options.loaders:
        loader = LOADERS[name]
        latencies = options.latencies if loader.uses_network else (0.0,)
        runs = []
        for workers in sorted(options.workers, key=lambda w: (w == 0, w)):
            for latency in latencies:
                for workload in options.workloads:
                    ms = round(latency * 1000)
                    runs.append(dict(id=f"{name} {workload} {ms}ms w{workers}", loader=name,
                                     workload=workload, latency=latency, latency_ms=ms, workers=workers,
                                     family=loader.family, mode=loader.mode))
        if runs:
            groups.append(runs)
    return groups


def load_faults_module() -> Any:
    """The ``integration/faults`` package (``integration`` is not one), loaded by path for its public API."""
    name = "loader_bench_faults"
    if name in sys.modules:
        return sys.modules[name]
    where = REPO / "integration" / "faults"
    spec = importlib.util.spec_from_file_location(name, where / "__init__.py", submodule_search_locations=[str(where)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Harness:
    def __init__(self, options: Options, progress: bool = True) -> None:
        self.options = options
        self.progress = progress
        self.results: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.samples: dict[str, bytes] = {}  # the data set's bytes, for checks after the run

    # ------------------------------------------------------------------ the whole run

    def run(self) -> list[dict[str, Any]]:
        from loader.tools.devserver import DevServer, weed_version

        from . import data

        opts = self.options
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        log_path = opts.log_path or opts.out_dir / "bench.log"
        groups = plan_runs(opts)
        began = time.perf_counter()
        with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
            self._say("starting the embedded S3 server (SeaweedFS) on 127.0.0.1 ...")
            server = stack.enter_context(DevServer(buckets=[data.BUCKET]))
            config = server.config
            decoding = {"decode", "fast"} & set(opts.workloads)
            small = min(opts.decode_samples, opts.samples) if decoding else opts.samples
            what = "photo-like JPEGs" if opts.images == "photo" else "synthetic 512x512 JPEGs"
            self._say(f"making {opts.samples} {what} and {opts.shards} tar shards"
                      + (f" (decode workload: the first {small}, a copy under {data.SMALL_PREFIX})"
                         if small < opts.samples else "") + " ...")
            t0 = time.perf_counter()
            samples = self.samples = data.make_samples(opts.samples, images=opts.images)
            full, uploads = data.prepare(samples, opts.shards, "", Path(tmp))
            sets = {"raw": full, "decode": full, "fast": full}
            if small < opts.samples:
                subset = dict(sorted(samples.items())[:small])
                sets["decode"], more = data.prepare(subset, opts.shards, data.SMALL_PREFIX, Path(tmp))
                sets["fast"] = sets["decode"]  # both decode workloads read the same copy
                uploads.update(more)
            made = time.perf_counter() - t0
            t0 = time.perf_counter()
            upload(config, uploads, bucket=data.BUCKET)
            uploaded = time.perf_counter() - t0
            self._say(f"{full.num_samples} objects ({full.mean_size / 1024:.0f} KiB mean) and "
                      f"{len(full.shard_keys)} shards ({full.shard_mb:.1f} MB each) made in {made:.1f}s, "
                      f"uploaded in {uploaded:.1f}s")
            endpoints = {"0": config.endpoint_url}
            faults = None
            for latency in opts.latencies:
                if latency > 0:
                    faults = faults or load_faults_module()
                    proxy = stack.enter_context(faults.FaultProxy(
                        config.endpoint_url, faults.FaultPlan(latency=latency), max_lifetime=6 * 3600))
                    endpoints[str(round(latency * 1000))] = proxy.endpoint_url
            context = dict(endpoints=endpoints, region=config.region, bucket=data.BUCKET,
                           sets={w: dataclasses.asdict(d) for w, d in sets.items()},
                           server_pid=server.pid, proxy_pid=os.getpid())
            plan = dict(epochs=opts.epochs, warmup_seconds=opts.warmup_seconds,
                        epoch_seconds=opts.epoch_seconds, full_epoch_limit=FULL_EPOCH_LIMIT)
            env = self._child_env(config)
            self.meta = self._meta(opts, weed_version(), sets, made, uploaded)
            with open(log_path, "a") as log:
                log.write(f"\n=== bench run {time.ctime()} ===\n")
                log.flush()
                self._run_groups(groups, context, plan, env, log)
        self.meta["total_seconds"] = time.perf_counter() - began
        return self.results

    def _child_env(self, config: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        env.update(AWS_ACCESS_KEY_ID=config.access_key_id, AWS_SECRET_ACCESS_KEY=config.secret_access_key,
                   AWS_REGION=config.region, AWS_DEFAULT_REGION=config.region,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        return env

    def _meta(self, opts: Options, weed: str, sets: dict[str, Any], made: float,
              uploaded: float) -> dict[str, Any]:
        import platform

        import psutil

        versions = {}
        for pkg in ("torch", "s3torchconnector", "webdataset", "obstore", "aioboto3", "boto3", "pillow"):
            with contextlib.suppress(Exception):
                from importlib.metadata import version
                versions[pkg] = version(pkg)
        return dict(
            started=time.strftime("%Y-%m-%d %H:%M:%S"), quick=opts.quick, samples=opts.samples,
            decode_samples=sets["decode"].num_samples, shards=len(sets["raw"].shard_keys),
            shard_mb=sets["raw"].shard_mb, decode_shard_mb=sets["decode"].shard_mb,
            mean_kib=sets["raw"].mean_size / 1024, workers=list(opts.workers), latencies=list(opts.latencies),
            workloads=list(opts.workloads), epochs=opts.epochs, warmup_seconds=opts.warmup_seconds,
            epoch_seconds=opts.epoch_seconds, cpus=os.cpu_count(), load_avg=os.getloadavg(),
            memory_gib=psutil.virtual_memory().total / 2**30, python=platform.python_version(),
            seaweedfs=weed, versions=versions, make_seconds=made, upload_seconds=uploaded,
        )

    # ------------------------------------------------------------------ children

    def _run_groups(self, groups: list[list[dict[str, Any]]], context: dict[str, Any],
                    plan: dict[str, Any], env: dict[str, str], log: Any) -> None:
        total = sum(map(len, groups))
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="run", desc="bench", dynamic_ncols=True)
        try:
            for runs in groups:
                pending = list(runs)
                while pending:
                    done = self._child(pending, context, plan, env, log, bar)
                    pending = pending[done:]
        finally:
            if bar is not None:
                bar.close()

    def _child(self, runs: list[dict[str, Any]], context: dict[str, Any], plan: dict[str, Any],
               env: dict[str, str], log: Any, bar: Any) -> int:
        """Run ``runs`` in one child; returns how many were settled (a crash settles one)."""
        proc = subprocess.Popen([sys.executable, "-m", "bench.child"], cwd=REPO, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        proc.stdin.write(json.dumps(dict(runs=runs, context=context, plan=plan)))
        proc.stdin.close()
        settled, current = 0, None
        deadline = time.monotonic() + CHILD_START_ALLOWANCE
        failure = None
        try:
            while settled < len(runs):
                try:
                    line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    failure = f"hung: no batch for {HANG_ALLOWANCE:.0f}s; child killed (stacks in {log.name})"
                    break
                deadline = time.monotonic() + HANG_ALLOWANCE  # any line is a sign of life
                if line is None:
                    proc.wait(timeout=30)
                    failure = f"child process died (exit code {proc.returncode}); see {log.name}"
                    break
                if line.startswith(START):
                    current = line[len(START):]
                    if bar is not None:
                        bar.set_postfix_str(current, refresh=True)
                elif line.startswith(RESULT):
                    self._record(json.loads(line[len(RESULT):]), bar)
                    settled += 1
                    current = None
        finally:
            if proc.poll() is None and failure is not None:
                log.write(f"\n--- {current}: {failure}; stacks of the child and its workers:\n")
                log.flush()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGUSR1)  # faulthandler: dump every thread's stack
                    time.sleep(2.0)
                    os.killpg(proc.pid, signal.SIGKILL)  # the child we started and its workers
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        if failure is not None and settled < len(runs):
            self._record(dict(runs[settled], error=failure), bar)
            settled += 1
        return settled

    def _record(self, result: dict[str, Any], bar: Any) -> None:
        self.results.append(result)
        if bar is not None:
            bar.update(1)
            if result.get("error"):
                bar.write(f"  {result['id']}: {result['error']}")

    def _say(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)
