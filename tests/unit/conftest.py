"""Session-scoped tiny models, ragged prompts and greedy references for the engine tests.

Building models and running Hugging Face ``generate`` one prompt at a time dominate the suite's
runtime, so they are shared; engines are cheap and built per test (see ``helpers.make_engine``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.helpers import MAX_NEW, NOISE, hf_greedy, make_prompts
from runtime.models import noisy_copy, tiny_llama

# Tiny models run ops of a few microseconds; with two intra-op threads on a 2-core box the OpenMP
# hand-offs cost ~7 ms per op under load (measured: 23 s vs 1.8 s for the same generation). One thread
# keeps the suite fast and its timing stable.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def other_draft():
    """Independently initialised: agrees with the target only by coincidence (acceptance ≈ 0)."""
    return tiny_llama(7)


@pytest.fixture(scope="session")
def noisy_draft(target):
    """The target plus weight noise: acceptance in between."""
    return noisy_copy(target, NOISE, 1)


@pytest.fixture(scope="session")
def target_copy(target):
    """A separate object with the target's weights (always agrees, but its forwards can be told apart)."""
    return copy.deepcopy(target)


@pytest.fixture(scope="session")
def prompts():
    """16 ragged prompts, lengths 1..40."""
    return make_prompts(5)


@pytest.fixture(scope="session")
def refs(target, prompts):
    """HF greedy references for ``prompts``, ``MAX_NEW`` tokens each, no EOS."""
    return [hf_greedy(target, p, MAX_NEW) for p in prompts]
