"""The speculative decoding engine: propose → verify → accept → commit over a batch of sequences.

The engine owns each sequence's committed tokens and drives two stages through ``Stages``: a proposer
(draft model, n-gram, or a remote draft pool) and a verifier (the target). In-process, ``LocalStages``
runs them directly; the Ray router hands in remote stages with the same interface, so there is one step
loop, not two.

Running sequences are split into ``micro_batches`` groups that take turns. While the verifier checks one
group's proposal, the next group's proposal is already being drafted (``step`` submits it before waiting
for the verify result); with remote stages on different workers that is the draft/verify overlap, and
in-process it degenerates to plain sequential execution. Sequences join and leave between steps
(continuous batching); a joining sequence is prefilled by its first verify forward and its draft cache
by its first proposal.

With ``draft_num`` > 1 every row gets that many candidate chains per step, one propose call per branch,
merged into one token tree the verifier checks in one pass (``engine/candidates.py``).

How much to speculate is the γ policy's one decision (``GammaPolicy.decide``, ``engine/gamma.py``): per
micro-batch, γ (0: a plain step) and the token tree's node budget, from the step costs and yields it is fed
after every decode step. A caller-seeded sampled row keeps the fixed γ, so its sample never depends on timing,
and a row the draft lost (a replica that never held it, or one that did not answer) is drafted once more, with
its whole history, before it is verified (and, if that fails too, waits for the group's next turns, up to
``seeded_draft_wait_s``): verified without its drafts, its sample would change from there on.

Structured outputs (issue 31): a request with a ``grammar`` gets its own matcher, advanced here on committed
tokens only. The draft masks its q with it (``ProposeItem.matcher``), the verifier masks the target's
logits with the γ + 1 masks filled here from the proposal (``VerifyItem.mask``), so acceptance compares the
masked p with the masked q and the law served is the target's masked one (docs/design.md, "Structured
outputs"). Where the grammar forces a run of tokens, the engine proposes that run itself and the draft
drafts after it (``engine/forced.py``). A constrained sequence ends with "stop" once its grammar is accepting
with no continuation.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Protocol, Sequence as Seq

from engine.candidates import Candidates
from engine.forced import WithForced, model_drafts
from engine.gamma import GammaPolicy, GammaState, Shape
from runtime.grammar import Grammar, Matcher, allow_all
from runtime.protocol import (GREEDY, ProposalBatch, ProposeItem, Proposer, SamplingParams, SyncItem,
                               VerifyItem, VerifyOutcome)
from engine.stats import SpecStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()  # stop strings; need the engine's ``detokenize``
    ignore_eos: bool = False
    grammar: Grammar | None = None  # structured output: the output is constrained to this grammar


@dataclass
class Sequence:
    seq_id: int
    request: Request
    tokens: list[int]  # prompt + generated, committed
    num_prompt: int
    micro_batch: int = 0
    proposer_base: int = 0  # committed tokens the proposer holds
    draft_lag: int = 0  # committed tokens the proposer took in when last asked to draft (the γ policy's entry cost)
    verifier_base: int = 0  # committed tokens the verifier holds
    gamma_state: GammaState = field(default_factory=GammaState)
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    failures: int = 0  # consecutive verify steps that could not run for this sequence
    draft_lost_at: float | None = None  # monotonic time the draft first lost this seeded row, in a row of losses
    text: str | None = None  # output text cut at a stop string, when one matched
    # Sampled with the caller's seed: drafts the configured γ, never a measured-cost one. The emitted
    # sample depends on the draft length, so a timing-driven γ would break "same seed, same sample".
    seeded: bool = False
    matcher: Matcher | None = None  # the grammar's state at the committed tokens (constrained requests)
    arrival: int = 0  # order of ``Engine.add`` calls: the youngest running sequence is preempted first

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit."""
        return self.request.max_tokens - len(self.generated)

    @property
    def behind(self) -> int:
        """Committed tokens the proposer has not taken in."""
        return len(self.tokens) - self.proposer_base


@dataclass(frozen=True)
class StepEvent:
    seq_id: int
    new_tokens: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error" | None while running


@dataclass(frozen=True)
class Output:
    seq_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    stats: SpecStats
    text: str | None = None


class Pending(Protocol):
    def result(self): ...


class Done:
    """An already-computed stage result."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


SEQ_ID_BLOCK = 1 << 32  # sequence ids one engine numbers its requests from (see ``random_first_seq_id``)


def random_first_seq_id() -> int:
    """Where an engine whose stages other engines may also reach starts numbering its sequences. A stage
    keys its caches by sequence id alone, so while a redeploy rolls the app the old and the new router (and
    their fidelity monitors) reach the same verifier: had both counted from 0, one router's sync of a
    sequence would have passed against the other's cache of the same id, and verified against the wrong
    prefix. Blocks of 2^32 ids, 2^30 of them, all below 2^62: two routers share a block with probability
    2^-30."""
    return secrets.randbelow(1 << 30) * SEQ_ID_BLOCK


class Stages(Protocol):
    def submit_propose(self, items: Seq[ProposeItem], shard: int) -> Pending:
        """Start drafting; ``shard`` (the micro-batch) lets a remote pool keep a group on one replica, and the
        items' ``branch`` (one call per branch with ``draft_num`` > 1) lets it put each branch on another."""

    def submit_verify(self, items: Seq[VerifyItem], proposal: ProposalBatch, shard: int) -> Pending: ...

    def release(self, seq_ids: Seq[int], shard: int) -> None: ...


class LocalStages:
    """Both stages in this process (the unit tests, the CLI, the benchmarks, a colocated replica)."""

    def __init__(self, verifier, proposer: Proposer | None):
        self.verifier = verifier
        self.proposer = proposer

    def submit_propose(self, items, shard=0):
        if self.proposer is None:
            return Done(ProposalBatch.empty([it.sync.seq_id for it in items]))
        return Done(self.proposer.propose(items))

    def submit_verify(self, items, proposal, shard=0):
        return Done(self.verifier.verify(items, proposal))

    def release(self, seq_ids, shard=0):
        self.verifier.release(seq_ids)
        if self.proposer is not None:
            self.proposer.release(seq_ids)


class Engine:
    _DRAFT_RETRY_S = 0.02  # a group whose rows all wait for their drafts tries again after this long

    def __init__(self, stages: Stages, *, policy: GammaPolicy | None = None, eos_token_ids: Iterable[int] = (),
                 max_len: int = 1024, max_running: int = 64, micro_batches: int = 1,
                 detokenize: Callable[[Seq[int]], str] | None = None, speculate: bool = True,
                 max_failures: int = 3, seeded_draft_wait_s: float = 1.5, draft_num: int = 1,
                 first_seq_id: int = 0, forced_tokens: bool = True, kv_blocks: int | None = None,
                 kv_block_size: int = 16):
        self.stages = stages
        self.policy = policy or GammaPolicy()
        self.eos = frozenset(eos_token_ids)
        self.max_len = max_len
        self.max_running = max_running
        self.micro_batches = max(1, micro_batches)
        self.detokenize = detokenize
        self.speculate = speculate
        self.max_failures = max_failures
        # How long a caller-seeded row waits for a draft that keeps losing it before it is verified without
        # drafts (its sample may then change). Time, not turns: a pool marked down fails every call at once.
        # Long enough for a pool a late probe marked down to come back, short enough that a pool that died
        # does not stall seeded streams (the others never wait for a pool that is down).
        self.seeded_draft_wait_s = seeded_draft_wait_s
        if draft_num < 1:
            raise ValueError(f"draft_num must be >= 1, got {draft_num}")
        self.draft_num = draft_num  # candidate chains per row and step, merged into a tree (engine.candidates)
        self.forced_tokens = forced_tokens  # constrained rows: the grammar's forced runs are proposed as drafts
        self.running: dict[int, Sequence] = {}
        self.finished: dict[int, Sequence] = {}  # until collected with ``output``
        self.waiting: list[Sequence] = []
        self.stats = SpecStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # add/cancel from other threads
        self._next_id = first_seq_id  # see random_first_seq_id
        self._turn = 0
        self._pending: dict[int, tuple[Pending, list[int]]] = {}  # micro-batch → in-flight proposal, its rows
        self.last_step_wait = 0.0  # seconds the last step spent waiting on stage results
        self.verifier_resyncs = 0  # re-prefills: the verifier lost sequences it had already prefilled
        self.seeded_redrafts = 0  # batches drafted again because the draft lost a caller-seeded row
        self._mask_seconds = 0.0  # the last step's filling of the verifier's grammar masks
        # KV blocks per stage pool (None: enough for max_running sequences at max_len, nothing to count).
        # Every pool holds at most the running sequences, so keeping their blocks within one pool's keeps
        # every pool within its own; a step may write γ_max + 1 (or a tree's nodes + 1) positions past them.
        self.kv_blocks, self.kv_block_size = kv_blocks, kv_block_size
        self._kv_headroom = 1 + max(self.policy.gamma_max, self.policy.tree_nodes, draft_num * self.policy.gamma_max)
        self.preemptions = 0  # sequences dropped from the running batch to free KV blocks, re-prefilled later
        self._arrivals = 0

    # -- requests --------------------------------------------------------------------------------------

    def add(self, request: Request, seq_id: int | None = None) -> int:
        """Queue a request (thread-safe); it joins the running batch at the next step."""
        if not request.prompt:
            raise ValueError("prompt must contain at least one token")
        if len(request.prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(request.prompt)} tokens does not fit the context of "
                             f"{self.max_len} tokens")
        if request.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer")
        longest = min(self.max_len, len(request.prompt) + request.max_tokens)
        if self.kv_blocks is not None and self._blocks_for(longest) > self.kv_blocks:
            raise ValueError(f"prompt + max_tokens ({longest} tokens) need more KV blocks than a pool holds "
                             f"({self.kv_blocks} × {self.kv_block_size} positions, kv.num_blocks); lower max_tokens")
        seeded = request.sampling.seed is not None and not request.sampling.greedy
        if request.sampling.seed is None and not request.sampling.greedy:
            # The stages key every random draw on the seed (``rng``); without one, all unseeded requests
            # would share seed 0 and identical prompts would get identical "samples".
            request = replace(request, sampling=replace(request.sampling, seed=secrets.randbits(63)))
        if seq_id is None:
            seq_id = self._next_id
            self._next_id += 1
        # The matcher is made here, on the caller's thread, not on the step thread.
        matcher = request.grammar.matcher() if request.grammar is not None else None
        self._arrivals += 1
        self._inbox.put(("add", Sequence(seq_id, request, list(request.prompt), len(request.prompt), seeded=seeded,
                                         matcher=matcher, arrival=self._arrivals)))
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence (thread-safe) and free its caches in both stages at the next step."""
        self._inbox.put(("cancel", seq_id))

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self._inbox.empty())

    # -- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        """One verify step of the next micro-batch (and the drafting of the one after it)."""
        events = self._drain_inbox()
        self._preempt()
        self._admit()
        groups = self._groups()
        if not groups:
            return events
        k = sorted(groups)[self._turn % len(groups)]
        self._turn += 1
        step_start = time.perf_counter()  # the γ policy's cost model: wall time of the whole step

        pending = self._pending.pop(k, None)
        # Verify exactly the rows the in-flight proposal was drafted for: a sequence that joined the group
        # after it went out waits for the group's next turn (a verify of rows the proposal lacks would be
        # refused and re-prefill the whole group); one that left since is dropped from the proposal.
        batch = self._drafted_for(pending, groups[k]) if pending is not None else []
        if not batch:
            batch = groups[k]
            pending = self._submit_propose(k, batch)
        t0 = time.perf_counter()
        proposal: ProposalBatch = pending[0].result().select([s.seq_id for s in batch])
        if self._lost_seeded(batch, proposal):
            # A caller-seeded sample depends on what was drafted: a row verified without its drafts (the draft
            # replica lost it, or did not answer) would change the sample from here on. Draft the batch once
            # more, those rows with their whole history, before verifying.
            pending = self._submit_propose(k, batch)
            proposal = pending[0].result().select([s.seq_id for s in batch])
            self.seeded_redrafts += 1
            # Lost in the redraft (the draft failed twice, or another replica took a row the first call held):
            # such a row waits for the group's next turn rather than be verified without drafts, for up to
            # seeded_draft_wait_s (then its sample may change).
            now = time.monotonic()
            waiting = set()
            for s in self._lost_seeded(batch, proposal):
                s.draft_lost_at = s.draft_lost_at or now
                if now - s.draft_lost_at < self.seeded_draft_wait_s:
                    waiting.add(s.seq_id)
            if waiting:
                batch = [s for s in batch if s.seq_id not in waiting]
                if not batch:
                    time.sleep(self._DRAFT_RETRY_S)  # the pool is failing every call: do not spin on it
                    return events
                proposal = proposal.select([s.seq_id for s in batch])
        caught_up = sum(s.draft_lag for s in batch)
        self.policy.observe_catch_up(len(batch), caught_up, proposal.draft_seconds)
        waited = time.perf_counter() - t0
        prefill = any(s.verifier_base == 0 for s in batch)  # a join or resync: not a decode step's cost
        verify = self.stages.submit_verify(self._verify_items(batch, proposal), proposal, k)
        following = sorted(groups)[self._turn % len(groups)]
        if following != k and following not in self._pending:
            self._pending[following] = self._submit_propose(following, groups[following])  # drafts meanwhile
        t0 = time.perf_counter()
        outcome: VerifyOutcome = verify.result()
        self.last_step_wait = waited + time.perf_counter() - t0
        committed = self._commit(batch, proposal, outcome, pending[0])
        if not prefill:  # a prefill's time is not what a decode step costs
            # With several micro-batches the wall time includes drafting the following one (every step pays
            # one drafting, so the accounting balances in steady state).
            seconds = time.perf_counter() - step_start
            self.policy.observe_step(len(batch), model_drafts(proposal, pending[0]), seconds,
                                     caught_up=caught_up)
        events.extend(committed)
        return events

    @staticmethod
    def _lost_seeded(batch: list[Sequence], proposal: ProposalBatch) -> list[Sequence]:
        """The caller-seeded rows of ``batch`` the draft lost in ``proposal``, set to resend their whole history."""
        lost = [s for s in batch if s.seeded and s.seq_id in proposal.resync]
        for s in lost:
            s.proposer_base = 0
        return lost

    def _submit_propose(self, shard: int, batch: list[Sequence]) -> tuple[Pending, list[int]]:
        runs = [self._forced(seq) for seq in batch]
        shape = self._shape(batch, [len(run) for run, _ in runs])
        items, forced = [], {}
        for seq, (run, ends) in zip(batch, runs):
            gamma = self._room(seq, self.policy.gamma if seq.seeded and self.speculate else shape.gamma)
            if seq.request.grammar is not None and seq.request.grammar.kind == "choice":
                # A choice is decided at the token where its strings part, where the draft can only guess, and
                # the grammar forces the rest: drafting would cost the draft a prefill of the prompt to save at
                # most one target pass of an answer a few tokens long (docs/design.md, "Structured outputs").
                gamma = 0
            if run:
                # The grammar drafts the run; the proposer drafts after it, unless the run completes the grammar;
                # the whole chain stays within the row's room and the step's (a caller-seeded row's, γ_max: its
                # sample must not depend on measured costs).
                room = self._room(seq, self.policy.gamma_max if seq.seeded else shape.room)
                ends, run = ends and len(run) <= room, run[:room]
                if run:
                    forced[seq.seq_id] = run
                    gamma = 0 if ends else max(0, min(gamma, room - len(run)))
            items.append(ProposeItem(SyncItem(seq.seq_id, seq.proposer_base, tuple(seq.tokens[seq.proposer_base:])),
                                     gamma, seq.request.sampling, matcher=seq.matcher, forced=tuple(run),
                                     nodes=shape.nodes))
        ids = [seq.seq_id for seq in batch]
        if not any(it.gamma for it in items):
            # Nothing for the proposer to draft (speculation off, choices, forced runs only): it is not called,
            # and a remote pool not reached; it catches up on these tokens when the rows next draft.
            pending = Done(ProposalBatch.empty(ids))
            return (WithForced(pending, forced) if forced else pending), ids
        for seq in batch:
            seq.draft_lag, seq.proposer_base = seq.behind, len(seq.tokens)
        # Constrained rows draft one chain: masks follow one path of tokens (trees are not masked per node yet).
        if self.draft_num == 1 or any(it.matcher for it in items):
            pending = self.stages.submit_propose(items, shard)
            return (WithForced(pending, forced) if forced else pending), ids
        branches = [self.stages.submit_propose([replace(it, branch=b) for it in items], shard)
                    for b in range(self.draft_num)]
        return Candidates(branches), ids

    @staticmethod
    def _drafted_for(pending: tuple[Pending, list[int]], group: list[Sequence]) -> list[Sequence]:
        """The group's sequences that ``pending`` was drafted for, in the proposal's row order."""
        members = {s.seq_id: s for s in group}
        return [members[i] for i in pending[1] if i in members]

    def _shape(self, batch: list[Sequence], forced: list[int]) -> Shape:
        if not self.speculate:
            return Shape(0)
        return self.policy.decide([seq.gamma_state for seq in batch],
                                  sampled=any(not seq.request.sampling.greedy for seq in batch),
                                  behind=[seq.behind for seq in batch], remaining=[seq.remaining for seq in batch],
                                  forced=forced)

    def _room(self, seq: Sequence, gamma: int) -> int:
        """γ for one row: drafting past max_tokens is wasted (the step emits up to γ + 1 tokens)."""
        room = self.max_len - len(seq.tokens) - 1
        return max(0, min(gamma, seq.remaining - 1, room))

    def _forced(self, seq: Sequence) -> tuple[list[int], bool]:
        """The run of tokens the grammar forces next, as far as the row may draft (none when not speculating:
        plain decoding stays target-only), and whether it completes the grammar (nothing to draft after it)."""
        if seq.matcher is None or not self.speculate or not self.forced_tokens:
            return [], False
        run = seq.matcher.forced_tokens()[: self._room(seq, self.policy.gamma_max)]
        if not run or not seq.matcher.consume(run):
            return [], False
        ends = seq.matcher.is_stopped
        seq.matcher.rollback(len(run))
        return run, ends

    def _verify_items(self, batch: list[Sequence], proposal: ProposalBatch) -> list[VerifyItem]:
        row = {s: b for b, s in enumerate(proposal.seq_ids)}
        items = []
        self._mask_seconds = 0.0
        for s in batch:
            mask = None
            if s.matcher is not None:
                t0 = time.perf_counter()
                drafts = proposal.row_tokens(row[s.seq_id]) if s.seq_id in row else []
                mask = allow_all(len(drafts) + 1, s.request.grammar.vocab_size)
                s.matcher.fill_mask(mask, drafts)
                self._mask_seconds += time.perf_counter() - t0
            items.append(VerifyItem(SyncItem(s.seq_id, s.verifier_base, tuple(s.tokens[s.verifier_base:])),
                                    s.request.sampling, mask))
        return items

    def _commit(self, batch: list[Sequence], proposal: ProposalBatch, outcome: VerifyOutcome,
                pending: Pending) -> list[StepEvent]:
        for seq_id in proposal.resync:
            if seq_id in self.running:
                self.running[seq_id].proposer_base = 0  # the proposer lost it: resend the whole history
        step_stats = SpecStats(draft_seconds=proposal.draft_seconds, verify_seconds=outcome.verify_seconds,
                               mask_seconds=proposal.mask_seconds + self._mask_seconds)
        forced = pending.forced if isinstance(pending, WithForced) else {}
        nodes = dict(zip(proposal.seq_ids, proposal.lengths.tolist()))  # drafts verified: a tree's size
        cached = dict(zip(outcome.seq_ids, outcome.cached))  # prompt tokens the verifier found in its prefix cache
        events, done = [], []
        for seq_id, emitted, accepted, proposed in zip(outcome.seq_ids, outcome.emitted, outcome.num_accepted,
                                                       outcome.num_proposed):
            seq = self.running.get(seq_id)
            if seq is None:
                continue
            if seq_id in outcome.resync:
                # The verifier lost this sequence (restart, rebuild): re-prefill from the committed
                # tokens next turn — or give up explicitly if that keeps failing.
                if seq.verifier_base > 0:
                    self.verifier_resyncs += 1
                seq.verifier_base = 0
                seq.failures += 1
                if seq.failures > self.max_failures:
                    seq.finish_reason = "error"
                    events.append(StepEvent(seq_id, (), "error"))
                    done.append(seq)
                continue
            seq.failures = 0
            seq.draft_lost_at = None
            seq.verifier_base = len(seq.tokens) + len(emitted)  # the verifier committed them itself
            new = self._append(seq, emitted)
            # Forced tokens are not the draft's: they count apart and teach the γ policy nothing about α. The
            # model's drafts after a forced run were verified only if the whole run was accepted.
            n_forced = len(forced.get(seq_id, ()))
            forced_accepted = min(accepted, n_forced)
            if forced_accepted < n_forced:
                proposed = accepted = 0
            else:
                proposed, accepted = proposed - n_forced, accepted - n_forced
            drafted = nodes.get(seq_id, 0) - n_forced
            if proposed or not n_forced:
                self.policy.observe(seq.gamma_state, proposed, accepted, drafted)
            for st in (seq.stats, step_stats):
                st.record(proposed, accepted, len(new), nodes=drafted)
                st.forced += forced_accepted
                st.cached_tokens += cached.get(seq_id, 0)
            events.append(StepEvent(seq_id, tuple(new), seq.finish_reason))
            if seq.finish_reason is not None:
                done.append(seq)
        self._finish(done)
        seq_share = len(batch) or 1
        for seq in batch:
            seq.stats.draft_seconds += proposal.draft_seconds / seq_share
            seq.stats.verify_seconds += outcome.verify_seconds / seq_share
            if seq.matcher is not None:
                seq.stats.mask_seconds += step_stats.mask_seconds / seq_share
        self.stats.merge(step_stats)
        return events

    def _append(self, seq: Sequence, emitted: list[int]) -> list[int]:
        """Commit emitted tokens one by one, stopping at EOS, a finished grammar, max_tokens, a stop string or
        the context end."""
        new = []
        for token in emitted:
            seq.tokens.append(token)
            new.append(token)
            eos = token in self.eos and not seq.request.ignore_eos
            if seq.matcher is not None and not eos and not seq.matcher.consume([token]):
                # The masks allow only what the matcher accepts, so this is a bug, not the caller's error.
                seq.finish_reason = "error"
            elif eos or (seq.matcher is not None and seq.matcher.is_stopped):
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.request.max_tokens or len(seq.tokens) >= self.max_len:
                seq.finish_reason = "length"
            elif seq.request.stop and self._hit_stop(seq):
                seq.finish_reason = "stop"
            if seq.finish_reason:
                break
        return new

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.detokenize(seq.generated)
        cuts = [text.find(s) for s in seq.request.stop if s in text]
        if not cuts:
            return False
        seq.text = text[: min(cuts)]
        return True

    def _finish(self, seqs: list[Sequence]) -> None:
        """Retire ``seqs`` and free their caches: one release per micro-batch, not per sequence (a step
        that finishes many rows would otherwise send as many frames to every stage)."""
        shards: dict[int, list[int]] = {}
        for seq in seqs:
            self.running.pop(seq.seq_id, None)
            self.finished[seq.seq_id] = seq
            shards.setdefault(seq.micro_batch, []).append(seq.seq_id)
        for shard, seq_ids in shards.items():
            self.stages.release(seq_ids, shard)

    # -- membership ------------------------------------------------------------------------------------

    def _drain_inbox(self) -> list[StepEvent]:
        events, cancelled = [], []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":
                self.waiting.append(arg)
                continue
            seq = self.running.get(arg) or next((s for s in self.waiting if s.seq_id == arg), None)
            if seq is None or seq.finish_reason is not None:  # unknown, or cancelled twice
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
            seq.finish_reason = "cancelled"
            cancelled.append(seq)
            events.append(StepEvent(seq.seq_id, (), "cancelled"))
        self._finish(cancelled)
        return events

    def _blocks_for(self, tokens: int) -> int:
        return -(-(tokens + self._kv_headroom) // self.kv_block_size)

    def _kv_in_use(self) -> int:
        return sum(self._blocks_for(len(s.tokens)) for s in self.running.values())

    def _preempt(self) -> None:
        """While the running sequences need more KV blocks than a pool has, the youngest goes back to the head
        of the queue, its caches released everywhere; it re-joins with its tokens when blocks free up (the
        re-prefill recomputes them, the output is unchanged)."""
        if self.kv_blocks is None:
            return
        while len(self.running) > 1 and self._kv_in_use() > self.kv_blocks:
            seq = self.running.pop(max(self.running.values(), key=lambda s: s.arrival).seq_id)
            self.stages.release([seq.seq_id], seq.micro_batch)
            seq.proposer_base = seq.verifier_base = 0
            self.waiting.insert(0, seq)
            self.preemptions += 1
            log.info("sequence %d preempted at %d tokens: %d running sequences need more than %d KV blocks",
                     seq.seq_id, len(seq.tokens), len(self.running) + 1, self.kv_blocks)

    def _admit(self) -> None:
        in_use = self._kv_in_use() if self.kv_blocks is not None else 0
        while self.waiting and len(self.running) < self.max_running:
            if self.kv_blocks is not None:
                need = self._blocks_for(len(self.waiting[0].tokens))
                if self.running and in_use + need > self.kv_blocks:
                    break
                in_use += need
            seq = self.waiting.pop(0)
            sizes = {k: 0 for k in range(self.micro_batches)}
            for s in self.running.values():
                sizes[s.micro_batch] += 1
            seq.micro_batch = min(sizes, key=lambda k: (sizes[k], k))
            self.running[seq.seq_id] = seq

    def _groups(self) -> dict[int, list[Sequence]]:
        groups: dict[int, list[Sequence]] = {}
        for seq in self.running.values():
            groups.setdefault(seq.micro_batch, []).append(seq)
        return groups

    # -- convenience -----------------------------------------------------------------------------------

    def generate(self, requests: Seq[Request]) -> list[Output]:
        """Run the given requests to completion (other running sequences keep going too)."""
        ids = [self.add(r) for r in requests]
        while any(i not in self.finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    def output(self, seq_id: int) -> Output:
        seq = self.finished.pop(seq_id)
        return Output(seq_id, seq.request.prompt, tuple(seq.generated), seq.finish_reason, seq.stats, seq.text)
