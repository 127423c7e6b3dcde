"""A tensor-parallel verifier group: ``tp_size`` Ray actors, one per rank, acting as one verify stage.

Contract:
- The group places its ranks in one placement group (STRICT_PACK: one node, the NVLink case; PACK or
  SPREAD when a group spans nodes), starts one ``VerifierRankActor`` per bundle, takes rank 0's node
  address and a port that is free there as the rendezvous, and has every rank build and shard the target
  (``verifier.tensor_parallel.TPVerifierRank``) from a plain model spec (``runtime.models.build_model``).
- ``relay`` / ``submit_relay`` send the verifier deployment's wire frame (``runtime.wire``; nothing is
  pickled) as it came to every rank (``verify`` encodes one first, for in-process callers), in the same
  order for every rank (submission happens under one lock), and return rank 0's outcome: one Ray Compiled
  Graph feeds every rank's ``call`` from one input when the ranks share a node
  (``deployments.transport.links.WorkerLink``), plain actor calls when they do not (``RankCallLink``);
  releases travel the same way, in order. The ranks' outcomes are compared; a disagreement (never expected: the
  logits are all-reduced) releases the rows concerned on every rank, so that they are re-prefilled through
  ``resync``.
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
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime import wire
from cluster.node import cpu_cores
from cluster.placement import resource_bundle
from cluster.threads import resolve_threads
from deployments.transport.links import RankCallLink, WorkerLink
from deployments.replica_process import check_memory, configure_process, model_process_env, use_threads
from runtime.protocol import ProposalBatch, VerifyItem, VerifyOutcome
from verifier.verify import AcceptanceConfig

log = logging.getLogger(__name__)

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")



@dataclass(frozen=True)
class GroupSpec:
    """A tensor-parallel verifier group: the target (a ``runtime.models.build_model`` spec), what each rank
    runs, where Ray places the ranks, and how long each phase may take. ``VerifierGroup.from_config`` builds
    it from the cluster config; the rank actors get it as it is."""

    model: Any
    tp_size: int = 1
    # what each rank runs
    device: str = "auto"
    dtype: str = "auto"
    max_slots: int = 64
    max_len: int = 1024
    kv_bucket: int = 16
    kv: dict = field(default_factory=dict)  # the ranks' KV pools: EngineSettings.kv_options()
    acceptance: AcceptanceConfig | None = None
    limits: wire.WireLimits | None = None  # None: what the ranks' runners can hold
    omp_threads: int | str | None = None  # None: the rank's whole-CPU reservation, at least 1
    tp_grain_size: int | None = None
    load: str = "full"
    memory_plan: dict | None = None  # {"bytes", "weights", "report"} of one rank, checked on its node
    backend: str | None = None
    cpu_shm_allreduce: bool = False
    # where the ranks go
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    accelerator_type: str | None = None
    placement_strategy: str | None = None  # None: STRICT_PACK, or PACK with span_nodes
    span_nodes: bool = False
    # how long
    placement_timeout_s: float = 120.0
    setup_timeout_s: float = 900.0
    verify_timeout_s: float = 300.0
    dist_timeout_s: float = 300.0

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1, got {self.tp_size}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.cpu_shm_allreduce and self.strategy != "STRICT_PACK":
            raise ValueError("cpu_shm_allreduce needs every rank on one node (placement_strategy STRICT_PACK)")
        if not (self.num_cpus > 0 or self.num_gpus > 0 or self.resources):
            raise ValueError("a rank must reserve something (num_cpus, num_gpus or resources)")

    @property
    def strategy(self) -> str:
        return self.placement_strategy or ("PACK" if self.span_nodes else "STRICT_PACK")

    @property
    def rank_device(self) -> str:
        return "cpu" if self.device == "auto" and self.num_gpus == 0 else self.device  # never grab an unreserved GPU

    @property
    def threads(self) -> int | str:
        return self.omp_threads if self.omp_threads is not None else max(1, int(self.num_cpus))

    def wire_limits(self, vocab_size: int) -> wire.WireLimits:
        """The config's limits with the ranks' vocabulary, or, without a config, what the runners can hold."""
        if self.limits is not None:
            return replace(self.limits, vocab_size=vocab_size)
        return wire.WireLimits(vocab_size=vocab_size, gamma_max=self.max_len,
                               max_batch=min(self.max_slots, wire.MAX_ROWS), max_seq_len=self.max_len)


class VerifierGroupError(RuntimeError):
    """The group lost a rank (and was rebuilt, unless ``rebuilt`` is False): retry the call."""

    def __init__(self, message: str, *, rebuilt: bool = False):
        super().__init__(message)
        self.rebuilt = rebuilt


@ray.remote(concurrency_groups={"control": 1})
class VerifierRankActor:
    """One rank. Model calls run one at a time, in submission order; ``address``/``health`` answer from a
    separate thread, also while a verify is blocked in a collective."""

    def __init__(self, rank: int, spec: GroupSpec):
        self.rank, self.spec = rank, spec
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

        spec, need = self.spec, self.spec.memory_plan or {}
        on_gpu = spec.num_gpus > 0
        threads = resolve_threads(spec.threads, cores=cpu_cores(), on_gpu=on_gpu, num_cpus=spec.num_cpus,
                                  where="verifier.num_threads",
                                  sharing=spec.tp_size if spec.strategy in ("STRICT_PACK", "PACK") else 1,
                                  weight_bytes=need.get("weights"))
        if need:
            check_memory("verifier rank", need["bytes"], spec.num_gpus, on_gpu, need["report"])
        configure_process(threads)
        dist = None
        if spec.tp_size > 1:
            dist = DistConfig(rank=self.rank, world_size=spec.tp_size, master_addr=master_addr,
                              master_port=master_port, backend=spec.backend, timeout_s=spec.dist_timeout_s,
                              cpu_shm_allreduce=spec.cpu_shm_allreduce, local_addr=ray.util.get_node_ip_address())
        self.tp = TPVerifierRank(spec.model, dist, device=spec.rank_device, dtype=spec.dtype,
                                 max_slots=spec.max_slots, max_len=spec.max_len, kv_bucket=spec.kv_bucket,
                                 kv=spec.kv, acceptance=spec.acceptance, threads=threads, tp_grain_size=spec.tp_grain_size,
                                 load=spec.load)
        self.limits = spec.wire_limits(self.tp.vocab_size)
        return {**self.tp.info(), "vocab_size": self.tp.vocab_size, "node": ray.util.get_node_ip_address()}

    def call(self, frame: bytes) -> bytes:
        """A verify or a release (``runtime.wire.serve_call``), sent by the group to every rank in one order
        over the group's compiled graph."""
        use_threads()  # torch keeps a thread count per OS thread
        return wire.serve_call(frame, self.limits, verifier=self.tp)

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

    def __init__(self, spec: GroupSpec, *, start: bool = True):
        self.spec = spec
        self.tp_size = spec.tp_size
        self._link: WorkerLink | RankCallLink | None = None  # feeds every rank: a compiled graph on one node
        self._lock = threading.RLock()
        self.actors: list = []
        self.rank_info: list[dict] = []
        self.generation = 0  # incremented by every rebuild
        self.rebuilds = 0
        self.disagreements = 0  # verify steps whose ranks did not agree (expected 0)
        self.master: tuple[str, int] | None = None
        self.limits: wire.WireLimits | None = None
        self._pg = None
        self._rebuilding_since: float | None = None  # monotonic start of the rebuild under way
        if start:
            self.start()

    @classmethod
    def from_config(cls, settings, cfg) -> "VerifierGroup":
        """From the verifier deployment's ``EngineSettings`` and ``ClusterConfig`` (see deployments.verifier)."""
        from cluster.memory_plan import plan
        from deployments.settings import wire_limits

        v, full = cfg.verifier, plan(cfg)
        rank = next((r for r in full.replicas if r.role == "verifier rank"), None)  # None when tp is 1
        return cls(GroupSpec(settings.target, tp_size=cfg.target.tensor_parallel, device=settings.device,
                             dtype=settings.dtype, max_slots=settings.max_slots, max_len=settings.max_len,
                             kv=settings.kv_options(), acceptance=settings.acceptance, limits=wire_limits(cfg), num_cpus=v.num_cpus,
                             num_gpus=v.num_gpus, resources=dict(v.resources), accelerator_type=v.accelerator_type,
                             placement_strategy=v.placement_strategy, omp_threads=v.num_threads,
                             memory_plan=rank and {"bytes": rank.model_bytes, "weights": rank.weights,
                                                   "report": full.report()}))

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
        spec = self.spec
        return resource_bundle(spec.num_cpus, spec.num_gpus, spec.accelerator_type, spec.resources)

    def _start(self) -> None:
        spec = self.spec
        self._pg = placement_group([self._bundle()] * self.tp_size, strategy=spec.strategy)
        try:
            ray.get(self._pg.ready(), timeout=spec.placement_timeout_s)
        except GetTimeoutError:
            raise VerifierGroupError(
                f"cannot place {self.tp_size} verifier ranks of {self._bundle()} with {spec.strategy} within "
                f"{spec.placement_timeout_s:.0f} s (not enough free resources on one node?)") from None
        env = {"TOKENIZERS_PARALLELISM": "false", **model_process_env(spec.threads)}
        self.actors = []
        for rank in range(self.tp_size):
            opts: dict[str, Any] = dict(
                num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}, max_restarts=0, max_task_retries=0)
            if spec.accelerator_type:
                opts["accelerator_type"] = spec.accelerator_type
            self.actors.append(VerifierRankActor.options(**opts).remote(rank, spec))
        try:
            self.master = ray.get(self.actors[0].address.remote(), timeout=spec.setup_timeout_s)
            self.rank_info = ray.get([a.setup.remote(*self.master) for a in self.actors],
                                     timeout=spec.setup_timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            raise VerifierGroupError(f"verifier group failed to start: {exc}") from exc
        self.limits = spec.wire_limits(self.rank_info[0]["vocab_size"])
        key = f"verifier group {self.generation}"
        nodes = {info["node"] for info in self.rank_info}
        self._link = WorkerLink(key, self.actors) if len(nodes) == 1 else RankCallLink(key, self.actors)

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
            t0 = self._rebuilding_since = time.monotonic()
            try:
                self._teardown()
                self.generation += 1
                self.rebuilds += 1
                self.start()
            finally:
                self._rebuilding_since = None
            log.warning("verifier group rebuilt (generation %d) in %.1f s", self.generation, time.monotonic() - t0)

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
                return VerifyPending(self, self.generation, self._link.send(wire.OP_VERIFY + frame))
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
        frame = wire.OP_RELEASE + wire.encode_release(wire.Release(tuple(seq_ids)))
        with self._lock:
            if self._link is not None:
                try:
                    self._link.release(frame, self.spec.verify_timeout_s)
                except Exception as exc:  # a lost release only leaves the slots to the ranks' LRU eviction
                    log.warning("verifier group release: %s", exc)

    def health(self, timeout_s: float = 10.0, *, rebuilding_ok: bool = False) -> dict:
        """Every rank's answer, or ``VerifierGroupError``. ``rebuilding_ok``: a rebuild still within its time
        limits counts as healthy — for Serve's replica health check, since restarting the replica would only
        start the same rebuild again, later (new ranks import torch for tens of seconds on a small host)."""
        # No lock: a verify being sent holds it for as long as the ranks take, and Serve's health check
        # must not wait behind that. A rebuild swaps ``actors`` whole, so this reads one generation's list.
        since = self._rebuilding_since
        if since is not None:  # the ranks being set up are not asked: a call cancelled by its caller's
            # timeout (the router's probe) would take its calls to them with it
            rebuilding_s = round(time.monotonic() - since, 1)
            if not rebuilding_ok or rebuilding_s > self.spec.placement_timeout_s + self.spec.setup_timeout_s:
                raise VerifierGroupError(f"the verifier group is being rebuilt ({rebuilding_s} s so far)")
            return {"tp_size": self.tp_size, "generation": self.generation, "rebuilds": self.rebuilds,
                    "master": None, "ranks": [], "rebuilding_s": rebuilding_s}
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
        return ray.get([a.info.remote() for a in actors], timeout=self.spec.verify_timeout_s)

    # -- gathering -------------------------------------------------------------------------------------

    def _collect(self, pending: VerifyPending) -> VerifyOutcome:
        deadline = time.monotonic() + self.spec.verify_timeout_s
        answers: dict[int, Any] = {}
        failure = None
        for rank, reply in enumerate(pending.replies):
            try:
                answers[rank] = reply.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # GetTimeoutError and RayChannelTimeoutError are TimeoutErrors
                failure = f"no answer from rank {rank} within {self.spec.verify_timeout_s} s"
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
