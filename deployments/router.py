"""The router: continuous batching and the step loop, and the typed Serve-handle API.

Each router replica runs one ``engine.engine.Engine`` — the same step loop the unit tests drive
in-process — on a dedicated thread, with ``RemoteStages`` in place of in-process stages. Requests enter
through ``generate`` / ``generate_stream`` (asyncio, on the replica's event loop), join the engine's
batch at the next step, and receive their tokens through a per-request queue. Admission control is
explicit: at most ``router.max_running`` sequences decode and ``router.max_queue`` wait; past that a
request fails at once with ``Overloaded`` (HTTP 503 + Retry-After) rather than queueing without bound.
A request whose caller goes away (cancelled handle call, closed HTTP stream) is cancelled in the
engine, which frees its KV slots in the verifier and the draft pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from ray import serve

from cluster.config import ClusterConfig
from deployments.api import (GenerateChunk, GenerateRequest, GenerateResponse, GenerationFailed, InvalidRequest,
                             Overloaded, RequestTimedOut, StageUnavailable)
from deployments.metrics import RouterMetrics
from deployments.settings import engine_settings, wire_limits
from deployments.stages import RemoteStages
from engine.engine import Engine, Output, Request, StepEvent
from engine.assembly import make_goodput, make_policy
from runtime.models import has_tokenizer, load_tokenizer
from runtime.protocol import SamplingParams

log = logging.getLogger("specserve.router")


@dataclass
class _Live:
    """A request between admission and its last chunk."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_tokens: int
    started: float = field(default_factory=time.monotonic)
    running: bool = False


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

    def __init__(self):
        self.steps = 0
        self.wall = self.schedule = 0.0
        self.compute = {"draft": 0.0, "verify": 0.0}
        self.transport = {"draft": 0.0, "verify": 0.0}
        self.calls = {"draft": 0, "verify": 0}

    def add(self, timings, wall: float, waited: float) -> None:
        self.steps += 1
        self.wall += wall
        self.schedule += max(0.0, wall - waited)
        for stage, call_wall, compute in timings:
            self.calls[stage] += 1
            self.compute[stage] += compute
            self.transport[stage] += max(0.0, call_wall - compute)

    def summary(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "step_ms": 1e3 * self.wall / n, "schedule_ms": 1e3 * self.schedule / n,
                **{f"{k}_ms": 1e3 * v / n for k, v in self.compute.items()},
                **{f"transport_{k}_ms": 1e3 * v / n for k, v in self.transport.items()},
                "calls": dict(self.calls)}


@serve.deployment(name="Router")
class Router:
    def __init__(self, args: dict, draft_handle, verifier_handle, *, engine_factory=None):
        cfg = ClusterConfig.from_dict(args)
        self.cfg = cfg
        settings = engine_settings(cfg)
        self.limits = wire_limits(cfg)
        self.tokenizer = _maybe_tokenizer(cfg.target.path)
        self.metrics = RouterMetrics()
        eos = [self.tokenizer.eos_token_id] if self.tokenizer is not None and \
            self.tokenizer.eos_token_id is not None else []
        if engine_factory is not None:
            self.engine = engine_factory(settings)
        else:
            self.stages = RemoteStages(
                draft_handle if settings.draft is not None else None, verifier_handle, self.limits,
                draft_timeout_s=cfg.draft_pool.timeout_s, verify_timeout_s=cfg.router.verify_timeout_s,
                probe_interval_s=cfg.router.probe_interval_s, probe_timeout_s=cfg.router.probe_timeout_s,
                on_fallback=self.metrics.fallback, shard_prefix=f"r{os.getpid()}")
            self.engine = Engine(self.stages, policy=make_policy(settings), eos_token_ids=eos,
                                 max_len=settings.max_len, max_running=cfg.router.max_running,
                                 micro_batches=settings.micro_batches, detokenize=self._detokenize,
                                 speculate=settings.draft is not None, goodput=make_goodput(settings))
        self.live: dict[int, _Live] = {}
        self._lock = threading.Lock()  # live + engine.add from the event loop vs the step thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_progress = time.monotonic()
        self.steps = 0
        self.profile = StepProfile()
        self.cancelled_total = 0  # requests whose caller went away or that timed out (see kv_usage)
        self._thread = threading.Thread(target=self._loop, name="specserve-step-loop", daemon=True)
        self._thread.start()

    # -- the step loop (its own thread) -------------------------------------------------------------

    def _loop(self) -> None:
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
            for ev in events:
                self._deliver(ev)
            stages = getattr(self, "stages", None)
            timings = stages.timings.drain() if stages else []
            wall = time.perf_counter() - t0
            self.profile.add(timings, wall, self.engine.last_step_wait)
            self.metrics.after_step(self.engine.stats, timings, wall, self.engine.last_step_wait,
                                    len(self.engine.running), len(self.engine.waiting))

    def _deliver(self, ev: StepEvent) -> None:
        with self._lock:
            live = self.live.get(ev.seq_id)
            if live is not None:
                live.running = True
        output = None
        if ev.finish_reason in ("stop", "length"):
            output = self.engine.output(ev.seq_id)
        elif ev.finish_reason is not None:
            self.engine.finished.pop(ev.seq_id, None)
        if live is None:
            return
        live.loop.call_soon_threadsafe(live.queue.put_nowait, (ev, output))

    # -- admission ----------------------------------------------------------------------------------

    def _admit(self, req: GenerateRequest) -> tuple[int, _Live, list[str]]:
        if not isinstance(req, GenerateRequest):
            raise InvalidRequest("expected a GenerateRequest", None)
        req.validate(vocab_size=self.limits.vocab_size, has_tokenizer=self.tokenizer is not None)
        prompt_param = "messages" if req.messages is not None else "prompt"
        prompt = self._prompt_ids(req)
        if not prompt:
            raise InvalidRequest("prompt encodes to no tokens", prompt_param)
        defaults = self.cfg.defaults
        room = self.cfg.target.max_model_len - len(prompt)
        # An unset max_tokens means "the default, or whatever room the context has left".
        max_tokens = req.max_tokens if req.max_tokens is not None else min(defaults.max_tokens, room)
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens but the context holds "
                                 f"{self.cfg.target.max_model_len}; shorten it", prompt_param,
                                 "context_length_exceeded")
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens {max_tokens} + prompt {len(prompt)} tokens exceed the context of "
                                 f"{self.cfg.target.max_model_len} tokens", "max_tokens", "context_length_exceeded")
        if req.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this deployment has none", "stop")
        sampling = SamplingParams(
            temperature=defaults.temperature if req.temperature is None else float(req.temperature),
            top_p=defaults.top_p if req.top_p is None else float(req.top_p),
            top_k=defaults.top_k if req.top_k is None else int(req.top_k),
            seed=req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "little"))
        request = Request(tuple(prompt), max_tokens=max_tokens, sampling=sampling, stop=tuple(req.stop),
                          ignore_eos=req.ignore_eos)
        loop = asyncio.get_running_loop()
        with self._lock:
            capacity = self.cfg.router.max_running + self.cfg.router.max_queue
            if len(self.live) >= capacity:
                raise Overloaded(f"{len(self.live)} requests in flight (limit {capacity}); retry later",
                                 retry_after_s=1.0)
            live = _Live(loop, asyncio.Queue(), len(prompt))
            seq_id = self.engine.add(request)
            self.live[seq_id] = live
        self._wake.set()
        return seq_id, live, list(req.stop)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if req.messages is None:
            return self.tokenizer(req.prompt)["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("the target's tokenizer has no chat template; use a completion prompt", "messages")
        try:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template itself may raise (e.g. "roles must alternate")
            raise InvalidRequest(f"the chat template rejected these messages: {exc}", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template adds its own

    async def _events(self, seq_id: int, live: _Live):
        """Yields (event, output) until the request finishes; cancels it on timeout or caller exit."""
        deadline = live.started + self.cfg.router.request_timeout_s
        finished = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                ev, output = await asyncio.wait_for(live.queue.get(), remaining)
                if ev.finish_reason == "error":
                    finished = True
                    self.metrics.request_done("error")
                    raise GenerationFailed("the verifier could not complete this request (replica lost "
                                           "repeatedly); nothing after the tokens already sent is valid")
                if ev.finish_reason == "cancelled":
                    finished = True
                    raise GenerationFailed("the request was cancelled")
                yield ev, output
                if ev.finish_reason is not None:
                    finished = True
                    self.metrics.request_done("ok")
                    return
        except asyncio.TimeoutError:
            self.metrics.request_done("timeout")
            raise RequestTimedOut(f"request timed out after {self.cfg.router.request_timeout_s:g} s") from None
        finally:
            with self._lock:
                self.live.pop(seq_id, None)
            if not finished:  # caller went away or timed out: free its caches everywhere
                self.engine.cancel(seq_id)
                self.cancelled_total += 1
                self.metrics.cancelled("running" if live.running else "queued")
                self._wake.set()

    # -- the handle API -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        seq_id, live, stop = self._admit(req)
        tokens: list[int] = []
        output: Output | None = None
        async for ev, out in self._events(seq_id, live):
            tokens.extend(ev.new_tokens)
            output = out or output
        text = None
        if self.tokenizer is not None:
            text = output.text if output.text is not None else self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerateResponse(text=text, token_ids=tokens, finish_reason=output.finish_reason,
                                prompt_tokens=live.prompt_tokens, completion_tokens=len(tokens),
                                stats=output.stats.as_dict())

    async def generate_stream(self, req: GenerateRequest):
        seq_id, live, stop = self._admit(req)
        stream = TextStream(self.tokenizer, stop)
        async for ev, out in self._events(seq_id, live):
            final = ev.finish_reason is not None
            text = stream.push(ev.new_tokens, out.text if final and out else None, final)
            if final:
                yield GenerateChunk(text=text, token_ids=list(ev.new_tokens), finish_reason=ev.finish_reason,
                                    prompt_tokens=live.prompt_tokens, completion_tokens=len(stream.tokens),
                                    stats=out.stats.as_dict() if out else None)
            elif ev.new_tokens:
                yield GenerateChunk(text=text, token_ids=list(ev.new_tokens))

    # -- introspection ------------------------------------------------------------------------------

    async def health(self) -> dict:
        """``status``: "unhealthy" when the step loop died or stalls with work waiting, or the verifier has no
        live replica; "degraded" when only the draft pool has none (decoding continues target-only); else
        "ok". Reads state the step loop and the stage prober keep: no stage is called here."""
        age = time.monotonic() - self.last_progress
        alive = self._thread.is_alive()
        stages = getattr(self, "stages", None)
        verifier = stages.verifier_live.snapshot() if stages else None
        draft = stages.draft_live.snapshot() if stages and stages.draft_live is not None else None
        if not alive:
            status, reason = "unhealthy", "the step loop died"
        elif age >= self.cfg.router.stall_s:
            status, reason = "unhealthy", f"no step completed for {age:.0f} s with requests waiting"
        elif verifier is not None and not verifier["up"]:
            status, reason = "unhealthy", f"verifier unavailable for {verifier['for_s']:.1f} s: {verifier['reason']}"
        elif draft is not None and not draft["up"]:
            status, reason = "degraded", (f"draft pool down for {draft['for_s']:.1f} s ({draft['reason']}); "
                                          "decoding continues target-only")
        else:
            status, reason = "ok", None
        return {"status": status, "reason": reason, "step_loop_alive": alive, "seconds_since_progress": round(age, 3),
                "verifier": verifier, "draft_pool": draft, "running": len(self.engine.running),
                "waiting": len(self.engine.waiting), "in_flight": len(self.live), "steps": self.steps}

    async def step_profile(self, reset: bool = False) -> dict:
        """Mean time per step by part (draft, verify, transport, schedule) since the last reset."""
        out = self.profile.summary()
        if reset:
            self.profile = StepProfile()
        return out

    async def info(self) -> dict:
        stages = getattr(self, "stages", None)
        return {"model": self.cfg.http.model_name, "vocab_size": self.limits.vocab_size,
                "max_model_len": self.cfg.target.max_model_len, "has_tokenizer": self.tokenizer is not None,
                "fallbacks": stages.fallbacks if stages else 0,
                "fallback_reasons": dict(stages.fallback_reasons) if stages else {},
                "verifier_resyncs": self.engine.verifier_resyncs,
                "shard_prefix": stages.shard_prefix if stages else None, "stats": self.engine.stats.as_dict(),
                "in_flight": len(self.live),
                "goodput": self.engine.goodput.as_dict() if self.engine.goodput is not None else None}

    async def kv_usage(self) -> dict:
        """KV slots in use in the verifier and the draft pool, and the cancelled-request counter.

        Asks each stage's ``stats()`` once per micro-batch shard key, so the answers come from the replicas
        that hold this router's sequences (with several replicas per stage, ones no shard routes to are not
        asked). ``slots_in_use`` sums per replica where stats name it (``actor_name``), else per shard key.
        Raises ``StageUnavailable`` at once for a stage marked down, and when the answers take longer than
        half of ``router.health_timeout_s`` (Serve queues calls to a deployment without live replicas); the
        other half is for the hops to and from the ingress, which waits ``health_timeout_s`` in all.
        """
        stages = getattr(self, "stages", None)
        out = {"cancelled": self.cancelled_total, "in_flight": len(self.live), "running": len(self.engine.running),
               "waiting": len(self.engine.waiting), "verifier": [], "draft_pool": []}
        if stages is None:
            return out
        asked = [("verifier", stages.verifier)]
        if stages.draft is not None and stages.draft is not stages.verifier:
            asked.append(("draft_pool", stages.draft))
        for name, live in (("verifier", stages.verifier_live), ("draft_pool", stages.draft_live)):
            if live is not None and not live.up:
                raise StageUnavailable(f"{live.name} unavailable: {live.reason}")
        calls = [(name, f"{stages.shard_prefix}-{shard}", stages._keyed(handle, shard).stats.remote())
                 for name, handle in asked for shard in range(self.cfg.router.micro_batches)]  # routed like steps
        bound = self.cfg.router.health_timeout_s / 2
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(resp for _, _, resp in calls)), bound)
        except asyncio.TimeoutError:
            for _, _, resp in calls:
                resp.cancel()
            raise StageUnavailable(f"the stages did not report within {bound:g} s") from None
        totals: dict[str, dict] = {name: {} for name, _ in asked}
        for (name, key, _), stats in zip(calls, answers):
            out[name].append({"shard": key, **stats})
            totals[name][stats.get("actor_name") or key] = stats.get("slots_in_use") or 0
        totals = {name: sum(per_replica.values()) for name, per_replica in totals.items()}
        out["slots_in_use"] = totals
        return out

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the step loop thread died")

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        stages = getattr(self, "stages", None)
        if stages is not None:
            stages.close()

    def _detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def _maybe_tokenizer(path: str):
    return load_tokenizer(path) if has_tokenizer(path) else None
