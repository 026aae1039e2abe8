"""A job of many processes against one simulated S3 prefix, on a simulated clock.

Each process runs the library's own ``ThrottleControl`` (its clock injected) with ``concurrency``
requests in flight, as the engine does: a request takes its turn as ``ThrottleControl.acquire``
does (waiting, looking every ``RECHECK`` whether its turn moved), is answered after a
latency, and a SlowDown is sent again after the engine's backoff (``loader.retry``). Processes
share nothing but the prefix: each sees only its own answers.

The prefix is modelled on what S3 documents and users report: ~5,500 GET/s answered, the rest
``503 SlowDown``, counted as a token bucket (half a second of burst) or as a sliding second; a
SlowDown closes the connection, so the next request on it pays a new one; under sustained load
the limit doubles (S3 repartitions the prefix). ``python tests/throttle_sim.py`` prints the table
of docs/design/throttle.md.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import statistics
from collections import deque

from loader.retry import RetryPolicy, backoff_delay
from loader.s3.throttle import RECHECK, ThrottleControl, start_window

S3_PREFIX_RATE = 5500.0  # GET/s a prefix answers (AWS's documented figure)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """The simulated limit: ``rate`` GET/s, ``shape`` "bucket" (holding ``burst`` seconds' worth)
    or "window" (at most ``rate`` answered in any one second); ``rises_after``: seconds of load
    after which it doubles (None: never)."""

    rate: float = S3_PREFIX_RATE
    shape: str = "window"
    burst: float = 0.5
    rises_after: float | None = None

    def limit(self, t: float) -> float:
        return self.rate * (2 if self.rises_after is not None and t >= self.rises_after else 1)

    def allowed(self, seconds: float) -> float:
        """GETs the prefix answers over ``seconds`` of load, at most (bursts aside)."""
        if self.rises_after is None or seconds <= self.rises_after:
            return self.rate * seconds
        return self.rate * self.rises_after + 2 * self.rate * (seconds - self.rises_after)


class Server:
    """Whether each GET arriving at the prefix is answered or refused."""

    def __init__(self, prefix: Prefix) -> None:
        self.prefix = prefix
        self.tokens = prefix.rate * prefix.burst
        self.at = 0.0
        self.window: deque[float] = deque()

    def answers(self, t: float) -> bool:
        limit = self.prefix.limit(t)
        if self.prefix.shape == "window":
            while self.window and self.window[0] <= t - 1.0:
                self.window.popleft()
            if len(self.window) >= limit:
                return False
            self.window.append(t)
            return True
        self.tokens = min(limit * self.prefix.burst, self.tokens + (t - self.at) * limit)
        self.at = t
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclasses.dataclass(frozen=True)
class Job:
    """The job's side: ``processes`` each with ``concurrency`` requests in flight; an answer takes
    ``latency`` s plus an exponential part of mean ``jitter``; a request on a connection a
    SlowDown closed pays ``reconnect`` s more; ``samples``: GETs each process needs (None: it
    reads until the run ends); ``starts``, ``stall``: when the processes start, and a busy machine."""

    processes: int = 64
    concurrency: int = 64
    latency: float = 0.025  # S3: tens of ms to the first byte of a small object
    jitter: float = 0.015
    reconnect: float = 0.010  # TCP and TLS handshakes
    samples: int | None = None
    starts: float = 0.01  # seconds from the first process's start to the last's, the others evenly between
    # a loaded machine: a process runs only every ``stall`` s (its own phase), so what it has to do
    # (book, send, take an answer) waits for then and goes out bunched (0: it runs at once)
    stall: float = 0.0
    # a DataLoader takes batches from its workers in turn: a process gets at most ``lead`` samples
    # ahead of the slowest (its prefetched batches), then waits for it (None: processes run apart)
    lead: int | None = None
    # a limit handed over (requests/s each process starts at: the last epoch's DataLoader workers'
    # share, ``loader.s3.handoff``); None: each starts knowing nothing
    handed: float | None = None


@dataclasses.dataclass
class Result:
    job: Job
    prefix: Prefix
    seconds: float  # the run: until the end, or until every process had all its samples
    good: list[int]  # good answers per process
    finished: list[float]  # when each process had its last sample (inf: not within the run)
    slowdowns: int
    per_second: list[list[int]]  # [good, SlowDown] answers in each second

    @property
    def total_rate(self) -> float:
        return sum(self.good) / self.seconds

    @property
    def of_limit(self) -> float:
        return sum(self.good) / self.prefix.allowed(self.seconds)

    @property
    def slowest_vs_mean(self) -> float:
        """The slowest process's rate against the mean (by samples, or by time to finish them)."""
        if self.job.samples is not None:
            return statistics.fmean(self.finished) / max(self.finished)
        return min(self.good) / statistics.fmean(self.good)

    @property
    def slowdown_share(self) -> float:
        return self.slowdowns / (self.slowdowns + sum(self.good))

    def slowdown_share_after(self, seconds: int) -> float:
        """The share once the job's first burst and its aftermath (the first ``seconds``) are past."""
        later = self.per_second[seconds:]
        return sum(b for _, b in later) / max(1, sum(g + b for g, b in later))

    def rise_found_after(self, share: float = 0.8) -> float | None:
        """Seconds from the limit's rise to the first second answered at ``share`` of the new
        limit (None: no rise, or not within the run)."""
        rise = self.prefix.rises_after
        if rise is None:
            return None
        for second in range(math.ceil(rise), len(self.per_second)):
            if self.per_second[second][0] >= share * self.prefix.limit(second):
                return second + 1 - rise
        return None


def simulate(job: Job, prefix: Prefix, seconds: float = 30.0, seed: int = 0) -> Result:
    """Every process's every request as events on one clock: book a turn, wait for it (looking
    every ``RECHECK`` whether it moved, simulated only when turns were moved), send, answer,
    repeat. A slot's retry after a SlowDown waits the engine's backoff first."""
    rng = random.Random(seed)
    now = [0.0]
    n = job.processes
    controls = [ThrottleControl(lambda: now[0], start_window(n), limit=job.handed)  # one job's readers
                for _ in range(n)]
    seen = [0] * n  # the schedule each process's waiting slots were last told of
    server = Server(prefix)
    policy = RetryPolicy()
    good = [0] * n
    left = [job.samples if job.samples is not None else -1] * n  # samples not yet asked for
    outstanding = [0] * n  # samples asked for, not yet answered well
    finished = [math.inf] * n
    slowdowns = 0
    per_second = [[0, 0] for _ in range(math.ceil(seconds) + 1)]
    # slot: [when it last looked, its turn, version (of its next look), attempt, when it looks next]
    waiting: list[dict[int, list]] = [{} for _ in range(n)]
    closed: set[int] = set()  # slots whose connection a SlowDown closed
    events: list[tuple[float, int, int, int, int, int]] = []  # (time, seq, kind, process, slot, extra)
    seq = 0
    BOOK, WAKE, ANSWER, SLOWDOWN, LOOK = range(5)

    def push(t: float, kind: int, p: int, slot: int, extra: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, p, slot, extra))

    def take_turn(t: float, p: int, slot: int, attempt: int) -> None:
        turn = controls[p].turn()
        if turn.taken:
            send(t, p, slot, turn.generation, attempt)
        else:
            waiting[p][slot] = [t, turn, 0, attempt, turn.due]
            if turn.due == math.inf:  # held for a place in the start window: an answer wakes it
                turn.wake = lambda: wake(p, slot)
            else:
                push(turn.due, WAKE, p, slot, 0)  # looks before then change nothing unless told

    def wake(p: int, slot: int) -> None:
        state = waiting[p].get(slot)
        if state is not None:
            state[2] += 1
            state[4] = now[0]
            push(now[0], WAKE, p, slot, state[2])

    def send(t: float, p: int, slot: int, generation: int, attempt: int) -> None:
        latency = job.latency + rng.expovariate(1 / job.jitter) if job.jitter else job.latency
        if slot in closed:
            closed.discard(slot)
            latency += job.reconnect
        if server.answers(t + latency / 2):  # the request reaches the prefix halfway
            push(t + latency, ANSWER, p, slot, generation)
        else:
            push(t + latency, SLOWDOWN, p, slot, generation * 1024 + min(attempt, 1023))

    parked: list[list[int]] = [[] for _ in range(n)]  # slots waiting for the slowest process (``lead``)

    def next_sample(t: float, p: int, slot: int) -> None:
        if left[p] == 0:
            return  # this slot has nothing more to ask
        if job.lead is not None and good[p] + outstanding[p] >= min(good) + job.lead:
            parked[p].append(slot)  # the DataLoader waits for a slower worker's batch first
            return
        left[p] -= 1
        outstanding[p] += 1
        take_turn(t, p, slot, 0)

    def tell_waiting(t: float, p: int) -> None:
        """Turns were moved: each waiting slot sees it at its next look, ``RECHECK`` after the
        one before (a slot already looking then or sooner sees it then: one event per look,
        however many moves)."""
        seen[p] = controls[p].schedule
        for slot, state in waiting[p].items():
            looked = state[0]
            look = looked + math.ceil((t - looked) / RECHECK + 1e-9) * RECHECK
            if look < state[4]:
                state[2] += 1
                state[4] = look
                push(look, WAKE, p, slot, state[2])

    phases = [rng.uniform(0, job.stall) for _ in range(n)]
    slots = 0
    for p in range(n):
        start = job.starts * p / max(1, n - 1)
        for _ in range(job.concurrency):
            push(start, BOOK, p, slots, 0)
            slots += 1
        push(start + RECHECK, LOOK, p, -1)
    end = seconds
    while events:
        t, order, kind, p, slot, extra = heapq.heappop(events)
        if t > seconds:
            break
        if job.stall:
            runs = phases[p] + math.ceil((t - phases[p]) / job.stall - 1e-9) * job.stall
            if runs > t + 1e-9:  # the process is not on a CPU now: it does this when it next runs
                heapq.heappush(events, (runs, order, kind, p, slot, extra))
                continue
        now[0] = t
        control = controls[p]
        if kind == BOOK:
            if extra == 0:
                next_sample(t, p, slot)
            else:
                take_turn(t, p, slot, extra)
        elif kind == WAKE:
            state = waiting[p].get(slot)
            if state is None or state[2] != extra:
                continue  # a look superseded by another
            turn = state[1]
            if control.take(turn):  # its turn came: it goes (a cut since moved it)
                del waiting[p][slot]
                send(t, p, slot, turn.generation, state[3])
            else:  # it sleeps towards where its turn is now, looking every RECHECK from here
                state[0] = t
                state[2] += 1
                state[4] = turn.due
                push(turn.due, WAKE, p, slot, state[2])
        elif kind == LOOK:  # the process's waiting requests look (each every RECHECK): the limit may grow
            if waiting[p]:
                slot, state = next(iter(waiting[p].items()))
                if control.take(state[1]):
                    del waiting[p][slot]
                    send(t, p, slot, state[1].generation, state[3])
            if left[p] != 0 or outstanding[p]:
                push(t + RECHECK, LOOK, p, -1)
        elif kind == ANSWER:
            control.on_answer(extra)
            good[p] += 1
            outstanding[p] -= 1
            per_second[int(t)][0] += 1
            if left[p] == 0 and outstanding[p] == 0:
                finished[p] = t
                if all(f < math.inf for f in finished):
                    end = t
                    break
            next_sample(t, p, slot)
            if job.lead is not None:  # the slowest may have moved: parked slots go on
                for q in range(n):
                    while parked[q] and good[q] + outstanding[q] < min(good) + job.lead:
                        next_sample(t, q, parked[q].pop())
        else:
            generation, attempt = divmod(extra, 1024)
            control.on_throttled(generation)
            closed.add(slot)
            slowdowns += 1
            per_second[int(t)][1] += 1
            push(t + backoff_delay(attempt, policy, rng), BOOK, p, slot, attempt + 1)
        if control.schedule != seen[p]:
            tell_waiting(t, p)
    return Result(job, prefix, end, good, finished, slowdowns, per_second[:math.ceil(end)])


SHAPES = {
    "sliding second": Prefix(shape="window"),
    "token bucket": Prefix(shape="bucket"),
    "doubles after 20 s": Prefix(shape="window", rises_after=20.0),
}


def row(name: str, r: Result) -> str:
    found = r.rise_found_after()
    return (f"| {r.job.processes} x {r.job.concurrency} | {name} | {r.total_rate:,.0f} | {r.of_limit:.2f}x | "
            f"{r.slowest_vs_mean:.2f} | {r.slowdown_share:.1%} | {r.slowdown_share_after(2):.1%} | "
            f"{'-' if found is None else f'{found:.0f} s'} |")


def table(jobs: tuple[Job, ...] = (Job(processes=2, concurrency=256), Job(processes=8), Job(processes=64),
                                   Job(processes=512, concurrency=16)),
          seconds: float = 40.0) -> str:
    """The markdown table of docs/design/throttle.md, one row per job and shape of limit."""
    lines = ["| processes x in flight | limit | total GET/s | of the limit | slowest / mean | SlowDown | "
             "after 2 s | rise found after |", "|---|---|--:|--:|--:|--:|--:|--:|"]
    print("\n".join(lines), flush=True)
    for job in jobs:
        for name, prefix in SHAPES.items():
            lines.append(row(name, simulate(job, prefix, seconds)))
            print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    table()
