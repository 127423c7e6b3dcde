"""CUDA graphs and on-device sampling on a GPU: graph replay equals eager, χ² of the device sampler.

Skipped without CUDA (``SPECSERVE_GPU_TEST_DEVICE=cpu`` runs them on the CPU, where graphs are off and the
replay checks reduce to static-vs-eager of the same code).
"""

from __future__ import annotations

import pytest
import torch

from draftpool.draft_model import DraftModelProposer
from engine.engine import Engine, LocalStages, Request
from engine.gamma import GammaPolicy
from runtime import rng
from runtime.models import noisy_copy, tiny_llama
from runtime.protocol import SamplingParams, SyncItem
from runtime.runner import ModelRunner
from runtime.sampling import race, warp_probs
from verifier.rejection import rejection_sample
from verifier.verify import VerifyStage

pytestmark = pytest.mark.timeout(600)

MAX_LEN = 128
P_MIN = 1e-3  # χ² p-value below which a distribution test fails


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² goodness of fit of ``samples`` [N] to ``probs`` [V], with torch only (the GPU image has no scipy).

    Cells expected fewer than 5 times are pooled; a sample outside the support fails outright.
    """
    samples, probs = samples.reshape(-1).long().cpu(), probs.double().reshape(-1).cpu()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert int(counts[probs <= 0].sum()) == 0, "samples fell outside the support"
    expected = probs / probs.sum() * samples.numel()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if float(expected[~big].sum()) > 0:
        obs = torch.cat([obs, counts[~big].sum().view(1)])
        exp = torch.cat([exp, expected[~big].sum().view(1)])
    if obs.numel() < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def pair(device):
    target = tiny_llama(0, vocab_size=512, hidden_size=128, num_layers=3)
    draft = noisy_copy(target, 0.03, 1)
    return target.to(device), draft.to(device)


def _engine(target, draft, graphs: bool, gamma: int | None = 4) -> Engine:
    opts = {"graphs": graphs, "pad_batch": True, "fuse": True}
    proposer = DraftModelProposer(draft, max_slots=16, max_len=MAX_LEN, **opts)
    verifier = VerifyStage(ModelRunner(target, max_slots=16, max_len=MAX_LEN, **opts))
    policy = GammaPolicy(gamma=gamma or 4, gamma_max=8, adaptive=gamma is None)
    return Engine(LocalStages(verifier, proposer), policy=policy, max_len=MAX_LEN)


def _prompts(n: int = 6) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(5)
    return [tuple(torch.randint(3, 512, (int(k),), generator=gen).tolist())
            for k in torch.randint(2, 30, (n,), generator=gen)]


@pytest.mark.parametrize("gamma", [4, None], ids=["gamma4", "adaptive"])
def test_graph_replay_equals_eager(device, pair, gamma):
    target, draft = pair
    greedy = [Request(p, max_tokens=32) for p in _prompts()]
    sampled = [Request(p, max_tokens=32, sampling=SamplingParams(temperature=0.9, top_k=40, seed=i))
               for i, p in enumerate(_prompts())]
    graphed_engine = _engine(target, draft, True, gamma)
    graphed = [o.tokens for o in graphed_engine.generate(greedy + sampled)]
    eager = [o.tokens for o in _engine(target, draft, False, gamma).generate(greedy + sampled)]
    assert graphed == eager
    if device.type == "cuda":
        graphs = graphed_engine.stages.verifier.runner.graphs
        assert graphs.captures > 0 and graphs.replays > graphs.captures


def test_replayed_logits_equal_eager_logits(device, pair):
    target, _ = pair
    out = {}
    for graphs in (True, False):
        runner = ModelRunner(target, max_slots=4, max_len=MAX_LEN, graphs=graphs, pad_batch=True, fuse=True)
        for s in range(3):
            runner.sync(SyncItem(s, 0, tuple(range(5 + s, 25 + s))))
        runner.forward([0, 1, 2], [[]] * 3, [1] * 3)  # prefill (eager)
        steps = []
        for t in range(4):  # the same shape each time: captured once, then replayed
            for s in range(3):
                runner.sync(SyncItem(s, 20 + t, (40 + t,)))
            steps.append(runner.forward([0, 1, 2], [[7, 8]] * 3, [3] * 3).clone())
        out[graphs] = torch.stack(steps)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


def test_device_hash_equals_cpu_hash(device):
    keys = rng.stream_keys(list(range(64)), [9] * 64, rng.DRAFT_TOKEN)
    counters = torch.arange(1000)
    cpu = rng.random_bits(keys.unsqueeze(1), counters)
    dev = rng.random_bits(keys.to(device).unsqueeze(1), counters.to(device))
    assert torch.equal(cpu, dev.cpu())


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.0, 12, 1.0), (1.0, 0, 0.85)])
def test_chi2_device_sampling(device, temperature, top_k, top_p):
    V, N = 64, 40_000
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(2)) * 1.5).to(device)
    full = lambda x, dtype=torch.float32: torch.full((N,), x, dtype=dtype, device=device)  # noqa: E731
    p = warp_probs(logits.expand(N, 1, V), full(temperature), full(top_k, torch.long), full(top_p))[:, 0]
    keys = rng.stream_keys(list(range(N)), [3] * N, rng.DRAFT_TOKEN, device)
    draws = race(p, rng.exponential(keys.unsqueeze(1), torch.arange(V, device=device)))
    assert chi2_pvalue(draws.cpu(), p[0].cpu()) > P_MIN
    same = race(p, rng.exponential(keys[:1].expand(N, 2).unsqueeze(1), torch.arange(V, device=device)))
    assert chi2_pvalue(same.cpu(), p[0].cpu()) < P_MIN  # negative control: one seed for every row
    # The rejection rule on the device: a draft from a different q, the first emitted token follows p.
    q = warp_probs((logits + torch.randn(V, generator=torch.Generator().manual_seed(3)).to(device) * 1.5)
                   .expand(N, 1, V), full(temperature), full(top_k, torch.long), full(top_p))
    drafts = race(q[:, 0], rng.exponential(rng.stream_keys(list(range(N)), [4] * N, rng.DRAFT_TOKEN, device)
                                           .unsqueeze(1), torch.arange(V, device=device))).unsqueeze(1)
    coins = rng.uniform(rng.stream_keys(list(range(N)), [3] * N, rng.VERIFY_COIN, device).unsqueeze(1),
                        torch.arange(1, device=device))
    noise = rng.exponential(rng.stream_keys(list(range(N)), [3] * N, rng.VERIFY_NOISE, device).unsqueeze(1),
                            torch.arange(V, device=device))
    out = rejection_sample(drafts, torch.ones(N, dtype=torch.long, device=device), p.unsqueeze(1).expand(N, 2, V),
                           q, coins, noise).output
    assert chi2_pvalue(out[:, 0].cpu(), p[0].cpu()) > P_MIN
