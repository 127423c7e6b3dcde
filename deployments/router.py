"""The router: the Serve shell around one ``engine.service.EngineService``, and the typed Serve-handle API.

Each router replica runs one engine — built by ``engine.assembly.make_engine``, the assembly the CLI, the
benchmarks and the unit tests use — on the service's step thread. With ``router.stages: remote`` the
engine's stages are a ``deployments.transport`` ``StageClient``: one Serve call per step to the draft pool
and one to the verifier, or with ``router.transport`` 'compiled' one call through a compiled-graph channel to
each stage replica's worker (the handles remain its fallback and serve the liveness probes and /debug). With
``local`` both models run inside this replica, which saves a stage call per step where a call costs a
sizeable share of a small model's step (docs/transport.md); the replica is then set up as a verifier replica
would be (``deployments.replica_process``) before the models load.

Requests enter through ``generate`` / ``generate_stream`` (asyncio, on the replica's event loop). Admission
is here: the request's checks, tokenization, the one context-length check, and the limit of
``router.max_running + max_queue`` live requests, past which a request fails at once with ``Overloaded``
(HTTP 503 + Retry-After) rather than queueing without bound. A request whose caller goes away is
cancelled in the engine (``EngineService.events``).

Structured outputs: admission compiles a request's grammar (``engine.grammar.GrammarCompiler``, cached, with
the config's time and size limits) on a worker thread, so a slow schema holds neither the event loop nor the
step thread; whatever cannot be compiled is an ``InvalidRequest`` naming ``structured_outputs`` (the ingress
names ``response_format`` when the grammar came from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time

from ray import serve

from cluster.config import ClusterConfig
from cluster.memory_plan import LOCAL_ROUTER
from deployments.api import (GenerateChunk, GenerateRequest, GenerateResponse, GenerationFailed, InvalidRequest,
                             Overloaded, RequestTimedOut, StageUnavailable)
from deployments.metrics import RouterMetrics
from deployments.replica_process import start_replica
from deployments.settings import engine_settings, wire_limits
from deployments.transport.client import StageClient, connect_stages
from deployments.transport.directory import app_key
from engine.assembly import make_engine
from engine.engine import Output, Request, random_first_seq_id
from engine.fidelity import FidelityMonitor, plain_redecoder
from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, map_tokenizer
from engine.service import EngineService, Live, StepProfile, TextStream
from runtime.models import has_tokenizer, load_tokenizer
from runtime.protocol import SamplingParams


@serve.deployment(name="Router")
class Router:
    def __init__(self, cfg: ClusterConfig, draft_handle, verifier_handle, generation: str):
        """``cfg`` was validated by ``deployments.app.build_app``; the handles are None with local stages;
        ``generation`` names the build whose stage workers this router uses
        (``deployments.transport.directory.app_key``)."""
        self.cfg, self.generation = cfg, generation
        settings = engine_settings(cfg)
        self.limits = wire_limits(cfg)
        self.tokenizer = load_tokenizer(cfg.target.path) if has_tokenizer(cfg.target.path) else None
        self.metrics = RouterMetrics()
        self.stages = None
        if cfg.router.stages == "local":
            start_replica(cfg, LOCAL_ROUTER)
        else:
            self.stages = self._stage_client(draft_handle if settings.draft is not None else None, verifier_handle,
                                             "r", on_fallback=self.metrics.fallback, workers=bool(cfg.worker_stages))
        eos = [self.tokenizer.eos_token_id] if self.tokenizer is not None and \
            self.tokenizer.eos_token_id is not None else []
        # Two routers reach the same stage replicas while a redeploy rolls the app: distinct sequence ids.
        self.first_seq_id = random_first_seq_id()
        self.engine = make_engine(settings, stages=self.stages, eos_token_ids=eos, detokenize=self._detokenize,
                                  first_seq_id=self.first_seq_id)
        self.grammars, self.no_grammars = self._grammar_compiler()
        self.service = EngineService(self.engine, capacity=cfg.router.max_running + cfg.router.max_queue,
                                     request_timeout_s=cfg.router.request_timeout_s, metrics=self.metrics)
        self.fidelity = self._fidelity_monitor(settings, verifier_handle, eos) \
            if cfg.router.fidelity_sample_rate > 0 else None

    def _fidelity_monitor(self, settings, verifier_handle, eos) -> FidelityMonitor:
        """Re-decodes a sample of finished greedy requests without speculation, on a one-slot plain engine of
        its own: the same target (shared weights with local stages; the same verifier replicas, on shards of
        their own, with remote ones), never the serving engine's slots."""
        plain = dataclasses.replace(settings, draft=None, max_slots=1, micro_batches=1)
        target = ({"target_model": self.engine.stages.verifier.runner.model} if self.stages is None
                  else {"stages": self._stage_client(None, verifier_handle, "fid")})
        engine = make_engine(plain, eos_token_ids=eos, detokenize=self._detokenize, **target)
        monitor = FidelityMonitor(self.cfg.router.fidelity_sample_rate,
                                  plain_redecoder(engine, first_seq_id=(1 << 62) + self.first_seq_id),
                                  on_result=self.metrics.fidelity)
        monitor.start()
        return monitor

    def _grammar_compiler(self) -> tuple[GrammarCompiler | None, str | None]:
        """The structured-output compiler of this deployment, or why it has none (said in each such 400)."""
        if self.tokenizer is None:
            return None, "this deployment has no tokenizer, so no structured outputs"
        limits = self.cfg.structured
        try:
            return GrammarCompiler(map_tokenizer(self.tokenizer, self.limits.vocab_size),
                                   max_bytes=limits.max_grammar_bytes, timeout_s=limits.compile_timeout_s,
                                   cache_size=limits.cache_size), None
        except GrammarError as exc:
            return None, str(exc)

    async def _grammar(self, req: GenerateRequest):
        """The compiled grammar ``req`` asks for (None: unconstrained), compiled on a worker thread."""
        spec = req.grammar_spec()
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(self.no_grammars, "structured_outputs")
        outcome = functools.partial(self.metrics.grammar, spec[0])
        try:
            return await asyncio.to_thread(self.grammars.compile, GrammarSpec(*spec), outcome)
        except GrammarError as exc:
            outcome("error", None)
            raise InvalidRequest(str(exc), "structured_outputs") from None

    @property
    def handle_routes(self) -> tuple:
        """The stages' Serve-handle routes (draft, verifier), for liveness and debugging; none with local stages."""
        return (None, None) if self.stages is None else self.stages.handle_routes

    def _stage_client(self, draft_handle, verifier_handle, shard: str, *, on_fallback=None,
                      workers: bool = False) -> StageClient:
        """The stages over Serve handles, or with ``workers`` over this build's stage workers (docs/transport.md)."""
        cfg = self.cfg
        return connect_stages(self.limits, draft_handle, verifier_handle, draft_timeout_s=cfg.draft_pool.timeout_s,
                              verify_timeout_s=cfg.router.verify_timeout_s, shard_prefix=f"{shard}{os.getpid()}",
                              probe_interval_s=cfg.router.probe_interval_s, probe_timeout_s=cfg.router.probe_timeout_s,
                              branches=cfg.speculation.draft_num, draft_rows=cfg.draft_pool.batch_size,
                              on_fallback=on_fallback,
                              workers_of=app_key(serve.get_replica_context().app_name, self.generation)
                              if workers else None)

    # -- admission ----------------------------------------------------------------------------------

    async def _admit(self, req: GenerateRequest, *, stream: bool) -> tuple[int, Live, list[str], Request]:
        if not isinstance(req, GenerateRequest):
            raise InvalidRequest("expected a GenerateRequest", None)
        req.validate(vocab_size=self.limits.vocab_size, has_tokenizer=self.tokenizer is not None)
        grammar = await self._grammar(req)
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
            seed=req.seed)  # None: the engine draws one and leaves the request's γ to the adaptive policy
        request = Request(tuple(prompt), max_tokens=max_tokens, sampling=sampling, stop=tuple(req.stop),
                          ignore_eos=req.ignore_eos, grammar=grammar)
        try:
            admitted = self.service.submit(request, stream=stream)
        except ValueError as exc:  # the engine's own admission checks (a KV pool too small for the request)
            raise InvalidRequest(str(exc), "max_tokens", "context_length_exceeded") from None
        if admitted is None:
            raise Overloaded(f"{len(self.service.live)} requests in flight (limit {self.service.capacity}); "
                             "retry later", retry_after_s=1.0)
        return (*admitted, list(req.stop), request)

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

    async def _events(self, seq_id: int, live: Live, request: Request):
        """The service's events for one request, its failures as the handle API's errors; times the request
        and offers it, finished, to the fidelity monitor."""
        clock = self.metrics.request_clock(live.started)
        try:
            async with contextlib.aclosing(self.service.events(seq_id, live)) as events:
                async for ev, output, produced in events:
                    clock.delivered(len(ev.new_tokens), produced)
                    if ev.finish_reason == "error":
                        self.metrics.request_done("error")
                        clock.finished("error")
                        raise GenerationFailed("the verifier could not complete this request (replica lost "
                                               "repeatedly); nothing after the tokens already sent is valid")
                    if ev.finish_reason == "cancelled":
                        raise GenerationFailed("the request was cancelled")
                    if ev.finish_reason is not None:
                        self.metrics.request_done("ok")
                        clock.finished("ok")
                        if self.fidelity is not None and output is not None:
                            self.fidelity.offer(request, output.tokens, ev.finish_reason)
                    yield ev, output
        except asyncio.TimeoutError:
            self.metrics.request_done("timeout")
            clock.finished("timeout")
            raise RequestTimedOut(f"request timed out after {self.cfg.router.request_timeout_s:g} s") from None

    # -- the handle API -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        seq_id, live, stop, request = await self._admit(req, stream=False)
        tokens: list[int] = []
        output: Output | None = None
        async for ev, out in self._events(seq_id, live, request):
            tokens.extend(ev.new_tokens)
            output = out or output
        text = None
        if self.tokenizer is not None:
            text = output.text if output.text is not None else self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerateResponse(text=text, token_ids=tokens, finish_reason=output.finish_reason,
                                prompt_tokens=live.prompt_tokens, completion_tokens=len(tokens),
                                stats=output.stats.as_dict())

    async def generate_stream(self, req: GenerateRequest):
        seq_id, live, stop, request = await self._admit(req, stream=True)
        stream = TextStream(self.tokenizer, stop)
        async for ev, out in self._events(seq_id, live, request):
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
        service, (draft_route, verifier_route) = self.service, self.handle_routes
        age = time.monotonic() - service.last_progress
        alive = service.alive
        verifier = verifier_route.live.snapshot() if verifier_route is not None else None
        draft = draft_route.live.snapshot() if draft_route is not None else None
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
                "waiting": len(self.engine.waiting), "in_flight": len(service.live), "steps": service.steps}

    async def step_profile(self, reset: bool = False) -> dict:
        """Mean time per step by part (draft, verify, transport, schedule) since the last reset."""
        out = self.service.profile.summary()
        if reset:
            self.service.profile = StepProfile()
        return out

    async def info(self) -> dict:
        stages, workers = self.stages, None
        if self.cfg.worker_stages and stages is not None:
            routes = {"draft": stages.draft, "verifier": stages.verifier}
            workers = {**{name: [link.key for link in r.all()] if r is not None else [] for name, r in routes.items()},
                       "rebuilds": sum(r.rebuilds for r in routes.values() if r is not None)}
        return {"model": self.cfg.http.model_name, "vocab_size": self.limits.vocab_size,
                "max_model_len": self.cfg.target.max_model_len, "has_tokenizer": self.tokenizer is not None,
                "transport": self.cfg.router.transport if self.stages is not None else "local",
                "workers": workers, "calls": dict(stages.calls) if stages is not None else {},
                "fallbacks": stages.fallbacks if stages is not None else 0,
                "fallback_reasons": dict(stages.fallback_reasons) if stages is not None else {},
                "verifier_resyncs": self.engine.verifier_resyncs,
                "seeded_redrafts": self.engine.seeded_redrafts,
                "shard_prefix": self.handle_routes[1].shard_prefix if self.stages is not None else None,
                "stats": self.engine.stats.as_dict(),
                "in_flight": len(self.service.live),
                "gamma_policy": self.engine.policy.as_dict()}

    async def kv_usage(self) -> dict:
        """KV slots in use in the verifier and the draft pool, and the cancelled-request counter.

        Asks each stage's ``stats()`` once per micro-batch shard key, so the answers come from the replicas
        that hold this router's sequences (with several replicas per stage, ones no shard routes to are not
        asked). ``slots_in_use`` sums per replica where stats name it (``actor_name``), else per shard key.
        Raises ``StageUnavailable`` at once for a stage marked down, and when the answers take longer than
        half of ``router.health_timeout_s`` (Serve queues calls to a deployment without live replicas); the
        other half is for the hops to and from the ingress, which waits ``health_timeout_s`` in all.
        """
        draft_route, verifier_route = self.handle_routes
        out = {"cancelled": self.service.cancelled_total, "in_flight": len(self.service.live),
               "running": len(self.engine.running),
               "waiting": len(self.engine.waiting), "verifier": [], "draft_pool": []}
        if verifier_route is None:
            return out
        asked = [("verifier", verifier_route)]
        if draft_route is not None and draft_route.handle is not verifier_route.handle:
            asked.append(("draft_pool", draft_route))
        for _, route in asked:
            if not route.live.up:
                raise StageUnavailable(f"{route.live.name} unavailable: {route.live.reason}")
        links = [(name, route.link(shard)) for name, route in asked for shard in range(self.cfg.router.micro_batches)]
        calls = [(name, link.key, link.handle.stats.remote()) for name, link in links]  # routed like steps
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
        if not self.service.alive:
            raise RuntimeError("the step loop thread died")

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()
        if getattr(self, "fidelity", None) is not None:
            self.fidelity.stop()
        if getattr(self, "stages", None) is not None:
            self.stages.close()

    def _detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
