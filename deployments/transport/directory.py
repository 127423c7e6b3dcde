"""How the router finds the stage workers of its app: named actors, looked up in Ray's GCS.

A stage replica in worker mode (``router.transport`` 'compiled', ``deployments.stage_host``) starts its
``StageWorker`` under the name ``worker_name(app_key(app, generation), stage, replica)``. The router's
``WorkerDirectory`` lists the live named actors every ``interval_s`` and keeps each stage's ``WorkerRoute``
equal to the workers of its own app and generation (``app_key``) that answer a ping (a worker still loading
its model does not yet). Pulling from the GCS instead of having replicas push registrations means a
restarted router finds every worker at once, and a replica that dies takes its worker, and so its name,
with it: the next refresh drops it and its route tears its graph down.
"""

from __future__ import annotations

import logging
import threading

import ray

log = logging.getLogger("specserve.transport")

WORKER_PREFIX = "specserve-worker"
STAGES = ("draft", "verifier")
DIRECTORY_INTERVAL_S = 1.0  # how often the router lists the workers; a stage without one is served by handles
READY_TIMEOUT_S = 0.5  # a worker that does not answer a ping this fast is still starting: next refresh


def app_key(app_name: str, generation: str) -> str:
    """What a worker's name and a directory's listing share: the Serve app and the build of it. Each
    ``build_app`` draws a new generation, so while a redeploy rolls the app, the draining router keeps to the
    workers of its own build and the new one to its own: two routers' graphs on one worker would block each
    other (an actor takes part in one compiled graph at a time)."""
    return f"{app_name}@{generation}"


def worker_name(app: str, stage: str, replica: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return f"{WORKER_PREFIX}:{app}:{stage}:{replica}"


def list_workers(app: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The live named stage workers of ``app``: stage → {name: (name, namespace)}."""
    out: dict[str, dict[str, tuple[str, str]]] = {stage: {} for stage in STAGES}
    prefix = f"{WORKER_PREFIX}:{app}:"
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(prefix):
            stage = name[len(prefix):].split(":", 1)[0]
            if stage in out:
                out[stage][name] = (name, entry["namespace"])
    return out


class WorkerDirectory:
    """Keeps the membership of each stage's route (``routes``: stage → ``WorkerRoute`` or None for a stage
    that is not there) equal to the live, ready workers of ``app``."""

    def __init__(self, routes: dict, app: str, interval_s: float):
        self.routes, self.app, self.interval_s = routes, app, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specserve-worker-directory", daemon=True)

    def start(self) -> "WorkerDirectory":
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def refresh(self) -> None:
        """Register the listed workers that are not members yet and answer a ping (one dropped after a
        timeout comes back this way), unregister members no longer listed."""
        for stage, names in list_workers(self.app).items():
            membership = self.routes.get(stage)
            if membership is None:
                continue
            members = {link.key: link.worker for link in membership.all()}
            current = {name: members[name] for name in names if name in members}
            for name in names.keys() - members.keys():
                handle = self._ready(*names[name])
                if handle is not None:
                    current[name] = handle
            if current.keys() != members.keys():
                membership.set(dict(sorted(current.items())))

    @staticmethod
    def _ready(name: str, namespace: str):
        try:
            handle = ray.get_actor(name, namespace=namespace)
            ray.get(handle.ping.remote(), timeout=READY_TIMEOUT_S)
            return handle
        except Exception as exc:  # gone again, or still loading its model
            log.debug("stage worker %s not ready: %s", name, exc)
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # the GCS briefly unreachable: keep the membership, try again
                log.warning("listing stage workers failed: %s", exc)
