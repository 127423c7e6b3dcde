"""An engine served to asyncio callers: its step loop on a thread of its own, live requests, event delivery.

The router replica (``deployments.router``) is a Serve shell around one ``EngineService``; nothing here
knows about Ray, so the unit tests drive the same service in-process. Requests are submitted from the event
loop, join the engine's batch at the next step and receive their ``StepEvent``s through a per-request
queue. A request whose caller goes away (a closed ``events`` generator) or that runs past its deadline is
cancelled in the engine, which frees its KV slots in both stages.

Delivery costs the step as little as it can: the step thread wakes each event loop once per step, for all
of that loop's requests, and a request that is not streamed gets its events only with its last one (held
on the step thread meanwhile, with the time each was produced). Every wake-up runs Python on the event
loop, and a small model's step releases the GIL at each op, so that Python delays the step
(docs/measurements.md#engine-service).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from engine.engine import Engine, Request, StepEvent

log = logging.getLogger("specserve.engine.service")


@dataclass
class Live:
    """A request between admission and its last event."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_tokens: int
    started: float = field(default_factory=time.monotonic)
    running: bool = False
    stream: bool = True  # False: events are held until the last one (see the module docstring)
    held: list[tuple[StepEvent, float]] = field(default_factory=list)  # (event, time.monotonic() it was produced)


class TextStream:
    """Incremental detokenization that never emits half a character or the start of a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.sent = 0

    def push(self, new_tokens, final_text: str | None = None, final: bool = False) -> str:
        self.tokens.extend(new_tokens)
        if self.tokenizer is None:
            return ""
        text = final_text if final_text is not None else self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not final:
            if text.endswith("\ufffd"):
                text = text[:-1]
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        delta = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta


class StepProfile:
    """Sums of per-step time by part. Draft and verify are the stages' own compute; transport is the
    rest of each stage call's wall time (serialisation, hops, queueing); schedule is the step loop's
    own work (everything in a step that is not waiting on a stage)."""

    SAMPLES = 20000  # per-call transport times kept for the percentiles (the latest ones)

    def __init__(self):
        self.steps = 0
        self.wall = self.schedule = 0.0
        self.compute = {"draft": 0.0, "verify": 0.0}
        self.transport = {"draft": 0.0, "verify": 0.0}
        self.calls = {"draft": 0, "verify": 0}
        self.samples = {"draft": deque(maxlen=self.SAMPLES), "verify": deque(maxlen=self.SAMPLES)}

    def add(self, timings, wall: float, waited: float) -> None:
        self.steps += 1
        self.wall += wall
        self.schedule += max(0.0, wall - waited)
        for stage, call_wall, compute in timings:
            self.calls[stage] += 1
            self.compute[stage] += compute
            self.transport[stage] += max(0.0, call_wall - compute)
            self.samples[stage].append(max(0.0, call_wall - compute))

    def summary(self) -> dict:
        """Means per step, and the p50/p99 of one stage call's transport (``transport_draft_p50_ms``…)."""
        n = max(self.steps, 1)
        quantiles = {}
        for stage, samples in self.samples.items():
            ordered = sorted(samples)
            for q in (50, 99):
                value = ordered[min(len(ordered) - 1, q * len(ordered) // 100)] if ordered else float("nan")
                quantiles[f"transport_{stage}_p{q}_ms"] = 1e3 * value
        return {"steps": self.steps, "step_ms": 1e3 * self.wall / n, "schedule_ms": 1e3 * self.schedule / n,
                **{f"{k}_ms": 1e3 * v / n for k, v in self.compute.items()},
                **{f"transport_{k}_ms": 1e3 * v / n for k, v in self.transport.items()},
                **quantiles, "calls": dict(self.calls)}


class EngineService:
    """Runs ``engine`` on a step thread. At most ``capacity`` requests are live (admitted, not yet done);
    ``metrics``, when given, is told of every step (``after_step``) and cancellation (``cancelled``)."""

    def __init__(self, engine: Engine, *, capacity: int, request_timeout_s: float, metrics=None):
        self.engine = engine
        self.capacity = capacity
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.live: dict[int, Live] = {}
        self._lock = threading.Lock()  # live + engine.add from the event loop vs the step thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_progress = time.monotonic()
        self.steps = 0
        self.profile = StepProfile()
        self.cancelled_total = 0  # requests whose caller went away or that timed out
        self._thread = threading.Thread(target=self._loop, name="specserve-step-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()

    # -- the step loop (its own thread) -------------------------------------------------------------

    def _loop(self) -> None:
        timings = getattr(self.engine.stages, "timings", None)  # remote stages time their calls
        while not self._stop.is_set():
            if not self.engine.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                self.last_progress = time.monotonic()
                continue
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception:  # a bug, not a replica failure (those become resyncs): fail loudly, keep serving
                log.exception("engine step failed; failing the running requests")
                events = [StepEvent(s, (), "error") for s in list(self.engine.running)]
                for seq_id in list(self.engine.running):
                    self.engine.cancel(seq_id)
            self.steps += 1
            self.last_progress = time.monotonic()
            self._deliver(events)
            drained = timings.drain() if timings is not None else []
            wall = time.perf_counter() - t0
            self.profile.add(drained, wall, self.engine.last_step_wait)
            if self.metrics is not None:
                self.metrics.after_step(self.engine.stats, drained, wall, self.engine.last_step_wait,
                                        len(self.engine.running), len(self.engine.waiting), self.engine.preemptions)

    def _deliver(self, events: list[StepEvent]) -> None:
        now = time.monotonic()
        with self._lock:
            lives = [self.live.get(ev.seq_id) for ev in events]
        handover: dict[asyncio.AbstractEventLoop, list] = {}
        for ev, live in zip(events, lives):
            output = None
            if ev.finish_reason in ("stop", "length"):
                output = self.engine.output(ev.seq_id)
            elif ev.finish_reason is not None:
                self.engine.finished.pop(ev.seq_id, None)
            if live is None:
                continue
            live.running = True
            live.held.append((ev, now))
            if live.stream or ev.finish_reason is not None:
                handover.setdefault(live.loop, []).append((live.queue, live.held, output))
                live.held = []
        for loop, items in handover.items():
            loop.call_soon_threadsafe(_hand_over, items)

    # -- requests (on the caller's event loop) -------------------------------------------------------

    def submit(self, request: Request, *, stream: bool = True) -> tuple[int, Live] | None:
        """Admit ``request``; None when ``capacity`` requests are live already. Not ``stream``: its caller
        gets all its events at once, with the last."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self.live) >= self.capacity:
                return None
            live = Live(loop, asyncio.Queue(), len(request.prompt), stream=stream)
            seq_id = self.engine.add(request)
            self.live[seq_id] = live
        self._wake.set()
        return seq_id, live

    async def events(self, seq_id: int, live: Live):
        """Yields (event, output, produced) up to the request's last event (``finish_reason`` set): ``output``
        only with the last, ``produced`` the ``time.monotonic()`` of the end of the step that produced the
        event. Raises ``TimeoutError`` past ``request_timeout_s``; closed early or timed out, it cancels the
        request."""
        loop = asyncio.get_running_loop()  # its clock need not be time.monotonic (uvloop's is not)
        deadline = loop.time() + live.started + self.request_timeout_s - time.monotonic()
        finished = False
        try:
            while not finished:
                async with asyncio.timeout_at(deadline):
                    deliveries, output = await live.queue.get()
                for i, (ev, produced) in enumerate(deliveries):
                    finished = ev.finish_reason is not None
                    yield ev, output if i == len(deliveries) - 1 else None, produced
        finally:
            with self._lock:
                self.live.pop(seq_id, None)
            if not finished:  # caller went away or timed out: free its caches everywhere
                self.engine.cancel(seq_id)
                self.cancelled_total += 1
                if self.metrics is not None:
                    self.metrics.cancelled("running" if live.running else "queued")
                self._wake.set()


def _hand_over(items: list[tuple[asyncio.Queue, list[tuple[StepEvent, float]], object]]) -> None:
    """On an event loop: one step's deliveries to its requests' queues."""
    for queue, deliveries, output in items:
        queue.put_nowait((deliveries, output))
