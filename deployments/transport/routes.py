"""Routes: which link a stage's call takes, and what a failed call does to the stage's standing.

- ``HandleRoute``: the stage's Serve deployment (``HandleLink`` keyed by shard and branch). Its liveness
  (``StageLiveness``) comes from the step's own calls and from ``StageProber``, a thread that pings every
  stage a few times a second. While the draft pool is down, steps do not call it at all (target-only, no
  waiting), and a step already waiting on it gives up as soon as it is marked down instead of waiting out
  ``draft_pool.timeout_s``. The router's ``/health`` reads the same state.
- ``WorkerRoute``: the stage replicas' workers (``WorkerLink``, one compiled graph each), kept equal to the
  app's live workers by ``directory.WorkerDirectory``. Shard ``s`` goes to worker ``s mod n``, so a
  micro-batch stays on one worker (its draft KV caches stay warm there) while membership is unchanged. A
  worker that dies or times out is dropped and its graph torn down; a stage with no worker (before the first
  is found, or after the last was lost) is called through its ``HandleRoute``, whose replicas pass the call
  on to their workers.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from ray.exceptions import RayActorError

from deployments.transport.links import HandleLink, WorkerLink

log = logging.getLogger("specserve.transport")

WAIT_SLICE_S = 0.05  # how often a step waiting on the draft pool checks whether it was marked down


class StageDown(Exception):
    """The stage was marked down while a step waited on its answer."""


class StageLiveness:
    """Whether a stage (the verifier, or the draft pool) has a replica that answers, from the latest evidence.

    A call whose replica died, or a probe that no replica answered in time, marks the stage down; a later
    success — a step call or a probe — marks it up. Success from a call that *started* before the latest
    failure is ignored: it may have been answered just before the replica died. Times are monotonic.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        # Down until a replica first answers: `serve deploy` starts an app's deployments together, so the
        # router may be up before any stage replica is (on a cluster, before the hosts for them have joined).
        self.up = False
        self.since = time.monotonic()
        self.reason: str | None = "no replica has answered yet"
        self.last_ok: float | None = None
        self.last_failure = -math.inf
        self.outages = 0

    def ok(self, started: float) -> None:
        with self._lock:
            if started < self.last_failure:
                return
            self.last_ok = time.monotonic()
            if not self.up:
                if self.outages:
                    log.warning("%s is back after %.2f s down", self.name, self.last_ok - self.since)
                self.up, self.since, self.reason = True, self.last_ok, None

    def failed(self, reason: str) -> None:
        with self._lock:
            self.last_failure = time.monotonic()
            if self.up:
                log.warning("%s is down: %s", self.name, reason)
                self.up, self.since, self.reason = False, self.last_failure, reason
                self.outages += 1
            elif self.last_ok is None:
                self.reason = f"no replica has answered yet ({reason})"

    def down_since(self, t: float) -> bool:
        """Marked down at or after monotonic time ``t`` (and still down)."""
        with self._lock:
            return not self.up and self.since >= t

    def snapshot(self) -> dict:
        with self._lock:
            now = time.monotonic()
            return {"up": self.up, "for_s": round(now - self.since, 3), "reason": self.reason,
                    "last_ok_s_ago": None if self.last_ok is None else round(now - self.last_ok, 3),
                    "outages": self.outages}


class StageProber:
    """A daemon thread that pings every stage each ``interval_s`` (``ping`` is answered on the replica's
    event loop, never behind model work, so a busy replica answers in milliseconds), and at once when
    ``probe_now`` is called (a step call just failed). A probe unanswered after ``timeout_s`` marks its stage
    down: a replica killed outright can take Ray seconds to report, and Serve queues calls to a deployment
    with no live replica instead of failing them."""

    def __init__(self, targets: list[tuple[object, StageLiveness]], *, interval_s: float, timeout_s: float):
        self.targets = targets
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specserve-stage-prober", daemon=True)

    def start(self) -> "StageProber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def probe_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._probe(self.targets)
            except Exception:  # a probe must never take the prober down with it
                log.exception("stage probe failed")

    def _probe(self, targets: list[tuple[object, StageLiveness]]) -> None:
        started = time.monotonic()
        calls = []
        for handle, live in targets:
            try:
                calls.append((handle.ping.remote(), live))
            except Exception as exc:  # the handle refused outright
                live.failed(f"probe refused: {type(exc).__name__}: {exc}")
        deadline = started + self.timeout_s
        for resp, live in calls:
            try:
                resp.result(timeout_s=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                resp.cancel()
                live.failed(f"no replica answered a probe within {self.timeout_s:g} s")
            except RayActorError as exc:
                live.failed(f"replica died ({type(exc).__name__})")
            except Exception as exc:
                live.failed(f"probe failed: {type(exc).__name__}: {exc}")
            else:
                live.ok(started)


class HandleRoute:
    """A stage's Serve deployment. ``skip_when_down``: the draft pool's — a step neither calls it while it is
    marked down nor keeps waiting on it once it is (the verifier's calls always go out: Serve holds them for
    a replacement replica)."""

    def __init__(self, handle, live: StageLiveness, prober: StageProber, *, shard_prefix: str,
                 skip_when_down: bool, branches: int = 1):
        self.handle, self.live, self.prober = handle, live, prober
        self.shard_prefix, self.skip_when_down, self.branches = shard_prefix, skip_when_down, branches

    def link(self, shard: int, branch: int = 0, part: int = 0) -> HandleLink:
        """The handle routed by the micro-batch's key — its branch's key for the candidates beyond the first
        (``draft_num``), its part's beyond the first ``draft_pool.batch_size`` rows — so Serve spreads a
        micro-batch's branches and parts over the draft replicas, each key staying on one while it lives."""
        return HandleLink(self.handle, f"{self.shard_prefix}-{shard}" + (f"-{branch}" if branch else "")
                          + (f"-p{part}" if part else ""))

    def pick(self, shard: int, branch: int = 0, part: int = 0) -> HandleLink | None:
        return None if self.skip_when_down and not self.live.up else self.link(shard, branch, part)

    def wait(self, link, reply, started: float, timeout_s: float) -> bytes:
        deadline = started + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return reply.get(max(0.0, min(WAIT_SLICE_S, remaining)) if self.skip_when_down else remaining)
            except TimeoutError:
                if self.skip_when_down and self.live.down_since(started):
                    reply.cancel()
                    raise StageDown from None
                if time.monotonic() >= deadline:
                    reply.cancel()
                    raise

    def ok(self, link, started: float) -> None:
        self.live.ok(started)

    def failed(self, link, exc: BaseException) -> None:
        """A dead replica marks the stage down at once; any failure asks for a probe, which marks the stage
        up again within milliseconds if another replica answers."""
        if isinstance(exc, RayActorError):
            self.live.failed(f"replica died ({type(exc).__name__})")
        self.prober.probe_now()

    def release(self, call: bytes, shard: int, timeout_s: float, part: int = 0) -> None:
        """Fire-and-forget: a lost release only leaves a slot to the replica's LRU eviction."""
        for branch in range(self.branches):
            try:
                self.link(shard, branch, part).release(call, timeout_s)
            except Exception as exc:
                log.warning("release failed: %s", exc)

    def close(self) -> None:
        pass


class WorkerRoute:
    """A stage's workers in registration order, and its ``HandleRoute`` (or nothing) while it has none."""

    def __init__(self, name: str, fallback: HandleRoute | None = None):
        self.name, self.fallback = name, fallback
        self._lock = threading.Lock()
        self.links: list[WorkerLink] = []
        self.rebuilds = 0

    # -- membership ------------------------------------------------------------------------------------

    def set(self, workers: dict[str, object]) -> None:
        """Make the membership exactly ``workers`` (key → actor handle): new keys get a link (a compiled
        graph, compiled outside the lock so steps on the other links go on meanwhile), gone keys have
        theirs torn down, unchanged keys keep theirs. A worker whose graph cannot be compiled (it died in
        between) is left out."""
        with self._lock:
            current = {link.key: link for link in self.links}
        kept = [k for k in workers if k in current and current[k].worker == workers[k]]
        new = []
        for key in workers.keys() - set(kept):
            try:
                new.append(WorkerLink(key, workers[key]))
            except Exception as exc:
                log.warning("%s worker %s left out: %s: %s", self.name, key, type(exc).__name__, exc)
        with self._lock:
            old, current = self.links, {link.key: link for link in self.links}
            self.links = [current[k] for k in kept if k in current] + sorted(new, key=lambda link: link.key)
            self.rebuilds += 1
        for link in old:
            if link not in self.links:
                link.close()
        log.info("%s workers: %s", self.name, [link.key for link in self.links])

    def all(self) -> list[WorkerLink]:
        with self._lock:
            return list(self.links)

    def drop(self, link: WorkerLink, reason: str) -> None:
        with self._lock:
            if link not in self.links:
                return
            self.links.remove(link)
            self.rebuilds += 1
        log.warning("%s worker %s dropped (%s); %d left", self.name, link.key, reason, len(self.links))
        link.close()

    # -- the route -------------------------------------------------------------------------------------

    def pick(self, shard: int, branch: int = 0, part: int = 0):
        with self._lock:
            link = self.links[(shard + branch) % len(self.links)] if self.links else None
        if link is None and self.fallback is not None:
            return self.fallback.pick(shard, branch, part)
        return link

    def wait(self, link, reply, started: float, timeout_s: float) -> bytes:
        if isinstance(link, HandleLink):
            return self.fallback.wait(link, reply, started, timeout_s)
        return reply.get(timeout=max(0.0, started + timeout_s - time.monotonic()))

    def ok(self, link, started: float) -> None:
        if isinstance(link, HandleLink):
            self.fallback.ok(link, started)

    def failed(self, link, exc: BaseException) -> None:
        """A worker that is gone, or did not answer in time, is dropped; one that raised for this call stays."""
        if isinstance(link, HandleLink):
            self.fallback.failed(link, exc)
        elif isinstance(exc, TimeoutError) or _worker_gone(exc):
            self.drop(link, type(exc).__name__)

    def release(self, call: bytes, shard: int, timeout_s: float, part: int = 0) -> None:
        """On every worker that may hold the sequences; a dead or hung worker is dropped, as a failed stage
        call would drop it. Through the handles too while the stage has no worker."""
        links = self.all()
        for link in links:
            try:
                link.release(call, timeout_s)
            except Exception as exc:
                self.drop(link, f"release: {type(exc).__name__}: {exc}")
        if not links and self.fallback is not None:
            self.fallback.release(call, shard, timeout_s, part)

    def close(self) -> None:
        with self._lock:
            links, self.links = self.links, []
        for link in links:
            link.close()


def _worker_gone(exc: BaseException) -> bool:
    """The worker (or its channel) is gone, as opposed to the worker raising for this one call."""
    from ray.exceptions import RayChannelError

    return isinstance(exc, (RayActorError, RayChannelError))
