"""A tensor-parallel verifier group: ``tp_size`` Ray actors, one per rank, acting as one verify stage.

Contract:
- The group places its ranks in one placement group (STRICT_PACK: one node, the NVLink case; PACK or
  SPREAD when a group spans nodes), starts one ``VerifierRankActor`` per bundle, takes rank 0's node
  address and a port that is free there as the rendezvous, and has every rank build and shard the target
  (``verifier.tensor_parallel.TPVerifierRank``) from a plain model spec (``runtime.models.build_model``).
- ``relay`` / ``submit_relay`` send the verifier deployment's wire frame (``runtime.wire``; nothing is
  pickled) as it came to every rank (``verify`` encodes one first, for in-process callers), in the same
  order for every rank (submission happens under one lock), and return rank 0's outcome. ``transport``
  says how: ``compiled``, one Ray Compiled Graph feeding every rank's ``call`` from one input (the
  router's ``router.transport`` 'compiled'), or ``actor``, one actor call per rank
  (``deployments.channel_stages.WorkerLink`` either way; releases travel the same way, in order). The
  ranks' outcomes are compared; a disagreement (never expected: the logits are all-reduced) releases the
  rows concerned on every rank, so that they are re-prefilled through ``resync``.
- A rank that dies or hangs (``RayActorError`` / no answer within ``verify_timeout_s``) takes the whole
  group with it: the group is torn down and rebuilt as a unit (``rebuild``), then ``VerifierGroupError``
  is raised so that the caller retries. The rebuilt group holds no sequence, so the retried verify answers
  every row with base > 0 in ``outcome.resync`` and the router resends those histories: a lost group costs
  a re-prefill, never a token.
- ``health`` raises ``VerifierGroupError`` when a rank does not answer; it never rebuilds (a verify does).

Each rank sets itself up as a replica does (``deployments.replica_process``): its torch threads are
``omp_threads`` — an integer, or 'auto' (``cluster.threads``: on CPU the node's cores divided among the ranks
a PACK/STRICT_PACK group puts on it, on GPU floor(num_cpus)) — checked against its node's cores, and by default
(``omp_threads`` None) its whole-CPU reservation, at least 1, so that ranks sharing a node do not
oversubscribe it. An integer also goes into the rank's ``OMP_NUM_THREADS`` from the start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime import wire
from cluster.node import cpu_cores
from cluster.threads import resolve_threads
from deployments.channel_stages import WorkerLink
from deployments.replica_process import check_memory, configure_process, model_process_env, use_threads
from deployments.stage_workers import OP_RELEASE, OP_VERIFY
from runtime.protocol import ProposalBatch, VerifyItem, VerifyOutcome
from verifier.verify import AcceptanceConfig

log = logging.getLogger(__name__)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")



def group_limits(options: dict[str, Any], vocab_size: int) -> wire.WireLimits:
    """The group's wire limits: the config's (``options["limits"]``, a dict across the actor boundary) with
    the ranks' vocabulary, or, without a config, what the ranks' runners can hold."""
    lim = {k: v for k, v in (options.get("limits") or {}).items() if k != "vocab_size"}
    lim.setdefault("gamma_max", options["max_len"])
    lim.setdefault("max_batch", min(options["max_slots"], wire.MAX_ROWS))
    lim.setdefault("max_seq_len", options["max_len"])
    return wire.WireLimits(vocab_size=vocab_size, **lim)

class VerifierGroupError(RuntimeError):
    """The group lost a rank (and was rebuilt, unless ``rebuilt`` is False): retry the call."""

    def __init__(self, message: str, *, rebuilt: bool = False):
        super().__init__(message)
        self.rebuilt = rebuilt


@ray.remote(concurrency_groups={"control": 1})
class VerifierRankActor:
    """One rank. Model calls run one at a time, in submission order; ``address``/``health`` answer from a
    separate thread, also while a verify is blocked in a collective."""

    def __init__(self, rank: int, world_size: int, spec: Any, options: dict):
        self.rank, self.world_size, self.spec, self.options = rank, world_size, spec, dict(options)
        self.tp = None
        self.limits: wire.WireLimits | None = None

    @ray.method(concurrency_group="control")
    def address(self) -> tuple[str, int]:
        """This node's routable address and a port free on it (used when this actor is rank 0)."""
        from verifier.tensor_parallel import free_port

        addr = ray.util.get_node_ip_address()
        return addr, free_port(addr)

    def setup(self, master_addr: str, master_port: int) -> dict:
        from verifier.tensor_parallel import DistConfig, TPVerifierRank

        opts = self.options
        need = opts.get("memory_plan") or {}
        threads = resolve_threads(opts["threads"], cores=cpu_cores(), on_gpu=opts["num_gpus"] > 0,
                                  num_cpus=opts["num_cpus"], where="verifier.num_threads",
                                  sharing=opts["threads_sharing"], weight_bytes=need.get("weights"))
        if need:
            check_memory("verifier rank", need["bytes"], opts["num_gpus"], opts["num_gpus"] > 0, need["report"])
        configure_process(threads)
        dist = None
        if self.world_size > 1:
            dist = DistConfig(rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                              master_port=master_port, backend=opts.get("backend"),
                              timeout_s=opts.get("dist_timeout_s", 300.0),
                              cpu_shm_allreduce=opts.get("cpu_shm_allreduce", False))
        acceptance = AcceptanceConfig(**opts["acceptance"]) if opts.get("acceptance") else None
        self.tp = TPVerifierRank(self.spec, dist, device=opts.get("device", "auto"), dtype=opts.get("dtype", "auto"),
                                 max_slots=opts["max_slots"], max_len=opts["max_len"],
                                 kv_bucket=opts.get("kv_bucket", 16), acceptance=acceptance,
                                 threads=threads, tp_grain_size=opts.get("tp_grain_size"),
                                 load=opts.get("load", "full"))
        self.limits = group_limits(opts, self.tp.vocab_size)
        return {**self.tp.info(), "vocab_size": self.tp.vocab_size, "node": ray.util.get_node_ip_address()}

    def call(self, frame: bytes) -> bytes:
        """A verify or a release (the first byte names it, as for a stage worker), sent by the group to
        every rank in one order: over the group's compiled graph, on the graph's thread, or as an actor
        call."""
        use_threads()  # torch keeps a thread count per OS thread
        op, body = frame[:1], frame[1:]
        if op == OP_VERIFY:
            items, proposal = wire.decode_verify(body, self.limits)
            return wire.encode_outcome(self.tp.verify(items, proposal))
        if op == OP_RELEASE:
            self.tp.release(list(wire.decode_release(body, self.limits).seq_ids))
            return b""
        raise wire.WireError(f"unknown rank operation {op!r}")

    def info(self) -> dict:
        return self.tp.info()

    @ray.method(concurrency_group="control")
    def health(self) -> dict:
        return {"rank": self.rank, "ready": self.tp is not None, "pid": os.getpid()}

    def shutdown(self) -> None:
        if self.tp is not None:
            self.tp.shutdown()


class VerifyPending:
    """An in-flight verify of one group generation; ``result()`` gathers the ranks' answers."""

    def __init__(self, group: "VerifierGroup", generation: int, replies: list):
        self.group, self.generation, self.replies = group, generation, replies

    def result(self) -> VerifyOutcome:
        return self.group._collect(self)


class VerifierGroup:
    """``tp_size`` rank actors acting as one verify stage (``verify``, ``release``, ``health``)."""

    def __init__(self, model_spec: Any, *, tp_size: int = 1, device: str = "auto", dtype: str = "auto",
                 max_slots: int = 64, max_len: int = 1024, kv_bucket: int = 16,
                 acceptance: AcceptanceConfig | None = None, limits: wire.WireLimits | None = None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, resources: dict[str, float] | None = None,
                 accelerator_type: str | None = None, placement_strategy: str | None = None, span_nodes: bool = False,
                 backend: str | None = None, cpu_shm_allreduce: bool = False,
                 omp_threads: int | str | None = None,
                 tp_grain_size: int | None = None, load: str = "full", memory_plan: dict | None = None,
                 transport: str = "actor", placement_timeout_s: float = 120.0,
                 setup_timeout_s: float = 900.0, verify_timeout_s: float = 300.0, dist_timeout_s: float = 300.0,
                 start: bool = True):
        if tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1, got {tp_size}")
        strategy = placement_strategy or ("PACK" if span_nodes else "STRICT_PACK")
        if strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {strategy!r}")
        if cpu_shm_allreduce and strategy != "STRICT_PACK":
            raise ValueError("cpu_shm_allreduce needs every rank on one node (placement_strategy STRICT_PACK)")
        if not (num_cpus > 0 or num_gpus > 0 or resources):
            raise ValueError("a rank must reserve something (num_cpus, num_gpus or resources)")
        self.model_spec = model_spec
        self.tp_size = tp_size
        self.strategy = strategy
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.resources = dict(resources or {})
        self.accelerator_type = accelerator_type
        self.placement_timeout_s, self.setup_timeout_s = placement_timeout_s, setup_timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.transport = transport  # how the ranks get each frame: a compiled graph, or actor calls
        self._link: WorkerLink | None = None
        if device == "auto" and num_gpus == 0:
            device = "cpu"  # a rank without a reserved GPU must not grab one it happens to see
        self.threads = omp_threads if omp_threads is not None else max(1, int(num_cpus))
        self.options: dict[str, Any] = {
            "device": device, "dtype": dtype, "max_slots": max_slots, "max_len": max_len, "kv_bucket": kv_bucket,
            "acceptance": asdict(acceptance) if acceptance is not None else None,
            "limits": asdict(limits) if limits is not None else None,
            "backend": backend, "cpu_shm_allreduce": cpu_shm_allreduce, "threads": self.threads,
            "threads_sharing": tp_size if strategy in ("STRICT_PACK", "PACK") else 1,
            "num_cpus": num_cpus, "num_gpus": num_gpus,
            "tp_grain_size": tp_grain_size, "load": load, "dist_timeout_s": dist_timeout_s,
            "memory_plan": memory_plan,
        }
        self._lock = threading.RLock()
        self.actors: list = []
        self.rank_info: list[dict] = []
        self.generation = 0  # incremented by every rebuild
        self.rebuilds = 0
        self.disagreements = 0  # verify steps whose ranks did not agree (expected 0)
        self.master: tuple[str, int] | None = None
        self.limits: wire.WireLimits | None = None
        self._pg = None
        if start:
            self.start()

    @classmethod
    def from_config(cls, settings, cfg, **overrides) -> "VerifierGroup":
        """From the verifier deployment's ``EngineSettings`` and ``ClusterConfig`` (see deployments.verifier)."""
        from cluster.memory_plan import plan
        from deployments.settings import wire_limits

        v, full = cfg.verifier, plan(cfg)
        rank = next((r for r in full.replicas if r.role == "verifier rank"), None)  # None when tp is 1
        kwargs = dict(tp_size=cfg.target.tensor_parallel, device=settings.device, dtype=settings.dtype,
                      max_slots=settings.max_slots, max_len=settings.max_len, acceptance=settings.acceptance,
                      limits=wire_limits(cfg), num_cpus=v.num_cpus, num_gpus=v.num_gpus, resources=v.resources,
                      accelerator_type=v.accelerator_type, placement_strategy=v.placement_strategy,
                      omp_threads=v.num_threads,
                      transport="compiled" if cfg.router.transport == "compiled" else "actor",
                      memory_plan=rank and {"bytes": rank.model_bytes, "weights": rank.weights,
                                            "report": full.report()})
        kwargs.update(overrides)
        return cls(settings.target, **kwargs)

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Place, start and set up every rank; raises ``VerifierGroupError`` (leaving nothing behind)."""
        with self._lock:
            if self.actors:
                return
            t0 = time.perf_counter()
            try:
                self._start()
            except BaseException:
                self._teardown()
                raise
            log.info("verifier group (tp=%d, generation %d) ready in %.1f s", self.tp_size, self.generation,
                     time.perf_counter() - t0)

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.num_cpus)} if self.num_cpus else {}
        if self.num_gpus:
            bundle["GPU"] = float(self.num_gpus)
        bundle.update(self.resources)
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001  # what the actor option reserves
        return bundle

    def _start(self) -> None:
        self._pg = placement_group([self._bundle()] * self.tp_size, strategy=self.strategy)
        try:
            ray.get(self._pg.ready(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            raise VerifierGroupError(
                f"cannot place {self.tp_size} verifier ranks of {self._bundle()} with {self.strategy} within "
                f"{self.placement_timeout_s:.0f} s (not enough free resources on one node?)") from None
        env = {"TOKENIZERS_PARALLELISM": "false", **model_process_env(self.threads)}
        self.actors = []
        for rank in range(self.tp_size):
            opts: dict[str, Any] = dict(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}, max_restarts=0, max_task_retries=0)
            if self.accelerator_type:
                opts["accelerator_type"] = self.accelerator_type
            self.actors.append(VerifierRankActor.options(**opts).remote(rank, self.tp_size, self.model_spec,
                                                                        self.options))
        try:
            self.master = ray.get(self.actors[0].address.remote(), timeout=self.setup_timeout_s)
            self.rank_info = ray.get([a.setup.remote(*self.master) for a in self.actors],
                                     timeout=self.setup_timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            raise VerifierGroupError(f"verifier group failed to start: {exc}") from exc
        self.limits = group_limits(self.options, self.rank_info[0]["vocab_size"])
        self._link = WorkerLink(f"verifier group {self.generation}", self.actors, self.transport)

    def _teardown(self, graceful: bool = False) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()
        actors, self.actors = self.actors, []
        if graceful and actors:
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=30)
            except Exception as exc:  # a dead or stuck rank: it is killed below anyway
                log.warning("verifier group shutdown: %s", exc)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        self.rank_info = []

    def rebuild(self) -> None:
        """Tear every rank down and start a fresh group (which holds no sequence)."""
        with self._lock:
            t0 = time.perf_counter()
            self._teardown()
            self.generation += 1
            self.rebuilds += 1
            self.start()
            log.warning("verifier group rebuilt (generation %d) in %.1f s", self.generation, time.perf_counter() - t0)

    def shutdown(self) -> None:
        with self._lock:
            self._teardown(graceful=True)

    # -- the stage -------------------------------------------------------------------------------------

    def submit_relay(self, frame: bytes) -> VerifyPending:
        """Send a verify frame, as it came, to every rank (each decodes it against the wire limits)."""
        with self._lock:
            if self._link is None:
                raise VerifierGroupError("the verifier group is not running")
            try:
                return VerifyPending(self, self.generation, self._link.send(OP_VERIFY + frame))
            except (RayActorError, RayChannelError) as exc:  # a rank is gone: rebuilt, then retried
                self._fail(self.generation, f"sending to the ranks failed: {type(exc).__name__}: {exc}")

    def relay(self, frame: bytes) -> VerifyOutcome:
        return self.submit_relay(frame).result()

    def verify(self, items: Sequence[VerifyItem], proposal: ProposalBatch) -> VerifyOutcome:
        return self.relay(wire.encode_verify(items, proposal))

    def release(self, seq_ids: Sequence[int]) -> None:
        """Fire-and-forget on every rank (ordered before any later verify); a dead rank shows up there."""
        if not seq_ids:
            return
        frame = OP_RELEASE + wire.encode_release(wire.Release(tuple(seq_ids)))
        with self._lock:
            if self._link is not None:
                try:
                    self._link.release(frame, self.verify_timeout_s)
                except Exception as exc:  # a lost release only leaves the slots to the ranks' LRU eviction
                    log.warning("verifier group release: %s", exc)

    def health(self, timeout_s: float = 10.0) -> dict:
        with self._lock:
            actors, generation = list(self.actors), self.generation
        if not actors:
            raise VerifierGroupError("the verifier group is not running")
        try:
            ranks = ray.get([a.health.remote() for a in actors], timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            raise VerifierGroupError(f"verifier group generation {generation}: a rank does not answer ({exc})") \
                from exc
        return {"tp_size": self.tp_size, "generation": generation, "rebuilds": self.rebuilds,
                "master": self.master, "ranks": ranks}

    def info(self) -> list[dict]:
        """Each rank's memory and layout (``TPVerifierRank.info``)."""
        with self._lock:
            actors = list(self.actors)
        return ray.get([a.info.remote() for a in actors], timeout=self.verify_timeout_s)

    # -- gathering -------------------------------------------------------------------------------------

    def _collect(self, pending: VerifyPending) -> VerifyOutcome:
        deadline = time.monotonic() + self.verify_timeout_s
        answers: dict[int, Any] = {}
        failure = None
        for rank, reply in enumerate(pending.replies):
            try:
                answers[rank] = reply.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # GetTimeoutError and RayChannelTimeoutError are TimeoutErrors
                failure = f"no answer from rank {rank} within {self.verify_timeout_s} s"
                break
            except (RayActorError, RayChannelError) as exc:  # a dead rank (a graph with one: every rank)
                failure = f"rank {rank} died: {exc}"
                break
            except RayTaskError as exc:
                answers[rank] = exc
        if failure is None:
            errors = [a for a in answers.values() if isinstance(a, RayTaskError)]
            if errors and len(errors) == len(answers):
                raise answers[0]  # every rank refused the same call the same way (e.g. a full KV pool)
            if errors:
                failure = f"ranks disagree: {len(errors)} of {len(answers)} failed ({errors[0]})"
        if failure is not None:
            self._fail(pending.generation, failure)
        outcomes = [wire.decode_outcome(answers[r], self.limits) for r in range(len(pending.replies))]
        return self._agree(outcomes)

    def _fail(self, generation: int, reason: str):
        with self._lock:
            if generation != self.generation:  # another call already rebuilt the group
                raise VerifierGroupError(f"verifier group generation {generation} is gone: {reason}", rebuilt=True)
            log.error("verifier group generation %d failed: %s; rebuilding", generation, reason)
            try:
                self.rebuild()
            except Exception as exc:
                raise VerifierGroupError(f"{reason}; rebuilding the group failed: {exc}") from exc
        raise VerifierGroupError(f"{reason}; the group was rebuilt, retry (sequences will resync)", rebuilt=True)

    def _agree(self, outcomes: list[VerifyOutcome]) -> VerifyOutcome:
        first = outcomes[0]
        bad = set()
        for other in outcomes[1:]:
            for i, seq_id in enumerate(first.seq_ids):
                if (other.emitted[i] != first.emitted[i] or other.num_accepted[i] != first.num_accepted[i]
                        or (seq_id in other.resync) != (seq_id in first.resync)):
                    bad.add(seq_id)
        if bad:
            # Ranks that committed different tokens would silently diverge: forget those rows everywhere so
            # that their next verify resyncs them from the router's (rank 0's) history.
            self.disagreements += 1
            log.warning("verifier ranks disagree on sequences %s; releasing them for a resync", sorted(bad))
            self.release(sorted(bad))
        return first
