"""CUDA graphs for the fixed-shape steps: each shape captured once, lazily, then replayed.

A decode step of a small model is bound by the Python that launches its kernels, not by the GPU
(docs/measurements.md#cuda-graphs). A captured graph replays all of a step's kernels with one launch.
The caller owns fixed input buffers for each key (the shape: batch bucket, tokens per row, KV length
bucket, …) and passes a function that reads only those buffers; the first call with a key runs the
function for real on a side stream (the warm-up CUDA asks for before a capture; its result is this call's
result), then captures it; later calls replay. Every graph draws from one shared memory pool, and at most
``max_graphs`` are kept: a key beyond the bound runs eagerly, so a workload with unusual shapes degrades to
the eager speed rather than to unbounded memory.

Without CUDA (or with ``enabled=False``) ``run`` simply calls the function: the CPU runs the same static
path eagerly, which is what the CPU tests compare with the dynamic path.

What a captured function may not do: read a tensor on the host (``.item()``, ``bool(t)``, ``.tolist()``),
allocate with a data-dependent shape, or use torch's stateful RNG. The step functions here use none of
these (``runtime.rng`` is counter-based for that reason).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

DEFAULT_MAX_GRAPHS = 96


class StepGraphs:
    def __init__(self, device: torch.device, *, enabled: bool | None = None, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.enabled = device.type == "cuda" if enabled is None else bool(enabled and device.type == "cuda")
        self.max_graphs = max_graphs
        self.device = device
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], object]) -> object:
        """``fn()``'s result: replayed from the graph of ``key`` when captured, else run (and captured)."""
        entry = self._graphs.get(key)
        if entry is not None:
            entry[0].replay()
            self.replays += 1
            return entry[1]
        if not self.enabled or len(self._graphs) >= self.max_graphs:
            self.eager_runs += 1
            return fn()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            result = fn()  # the warm-up, for real: the step's own result (KV writes are idempotent)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a Ray actor's other stage) must not invalidate the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = fn()
        self._graphs[key] = (graph, output)
        self.captures += 1
        return result
