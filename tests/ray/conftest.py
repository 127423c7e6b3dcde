"""One local Ray cluster per pytest session; apps are (re)deployed per test module.

A cluster start costs 5-10 s here, so it is shared. It is started as ``specserve serve`` starts its own
(``deployments.loopback.init_local_ray``): every socket on loopback, which the fixture checks. Token auth
is off — a throwaway cluster that nothing beyond this machine can reach (README, Security). The
dashboard is off (it costs ~1 GiB), and the logical CPU count is raised so that several fractional-CPU
replicas fit on this 2-core box.

test_sockets.py runs first: its own launch then finds Ray's fixed dashboard-agent port free, which the
session cluster would otherwise hold. The modules that share ``openai_app.main_app()`` run last, one after
another: the app is deployed once (~25 s here) and no other module's timings share the box with it.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # deployments.loopback.LOCAL_ONLY_ENV, before ray is imported

ray = pytest.importorskip("ray")

from deployments.loopback import init_local_ray  # noqa: E402


@pytest.fixture(scope="module")
def app(ray_cluster):
    """The app the ``MAIN_APP_MODULES`` share (``openai_app.main_app``); a module may define its own ``app``."""
    from tests.ray.openai_app import main_app

    return main_app()


@pytest.fixture(scope="module")
def client(app):
    from tests.ray.openai_app import openai_client

    return openai_client(app)


MAIN_APP_MODULES = ("test_openai_api.py", "test_openai_errors.py", "test_structured_outputs.py",
                    "test_reliability_http.py")


def pytest_collection_modifyitems(items):
    # stable: the others keep their order
    items.sort(key=lambda item: (item.path.name != "test_sockets.py", item.path.name in MAIN_APP_MODULES))


@pytest.fixture(scope="session")
def ray_cluster():
    if not ray.is_initialized():
        # Metrics every 2 s instead of Ray's 10: test_prometheus waits for two exports of its traffic.
        init_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                       _system_config={"metrics_report_interval_ms": 2000})
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


from deployments.launch import deploy, wait_running  # noqa: E402,F401  (re-exported for the tests)


def random_prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts of 1-39 token ids of the builtin tiny vocabulary (reproducible from ``seed``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen)
    return [torch.randint(3, 256, (int(k),), generator=gen).tolist() for k in lengths]


def tiny_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference: the builtin tiny target alone, greedy, one prompt at a time, with HF ``generate``."""
    import torch

    from runtime.models import build_model, resolve_spec

    target = build_model(resolve_spec("builtin:tiny", "target"), device="cpu")
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def delete_app(name: str) -> None:
    """Delete an app between test modules; a slow teardown on a loaded box must not fail the tests."""
    from ray import serve

    try:
        serve.delete(name)
    except TimeoutError as exc:
        print(f"warning: {exc}")
