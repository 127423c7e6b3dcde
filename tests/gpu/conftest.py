"""GPU tests: skipped cleanly without CUDA (CI and the CPU boxes never have one).

Every test under tests/gpu/ gets the ``gpu`` marker and, when no CUDA device is visible, a skip marker at
collection, so the CPU suite stays green and reports them as skipped. ``SPECSERVE_GPU_TEST_DEVICE=cpu``
runs the same checks on the CPU (slow, but it exercises the test code where no GPU is at hand).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("SPECSERVE_GPU_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
SKIP_REASON = "needs CUDA (SPECSERVE_GPU_TEST_DEVICE=cpu runs these checks on the CPU instead)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if DEVICE is None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def device() -> torch.device:
    if DEVICE is None:
        pytest.skip(SKIP_REASON)
    dev = torch.device(DEVICE)
    if dev.type == "cuda":
        # fp32 must be fp32: no TF32 in matmuls (it would turn the fp32 identity test into a bf16-ish one).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    else:
        torch.set_num_threads(1)
    return dev
