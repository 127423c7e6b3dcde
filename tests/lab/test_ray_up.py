"""specserve brought up with the unchanged ``ray up`` on namespace hosts (``tools.lab_cluster``): a head, two
"target" hosts holding one rank each of the tensor-parallel verifier (gloo across the lab network), a
"draft" host holding the draft pool, and an outsider host on the same bridge that is not in the cluster.

The cluster file comes from ``tools.ray_launch.on_prem``, which renders the shipped on-prem file too, so
the hosts run the shipped set-up and start commands. Checks: ``ray up`` / ``ray down`` exit 0; actors sit
on the hosts their role resources name; 200 requests over HTTP with the official ``openai`` client
(greedy and sampled with a seed, streaming and not) return what the in-process engine returns for the same
config; from the outsider, the Ray ports answer but nothing gets in without the token, and the HTTP API
answers 401 without the key. One cluster for the module: bringing it up costs about two minutes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.lab.conftest import lab_skip_reason, leftovers, net_namespace_ids
from tools.hostlab import HostLab
from tools.lab_cluster import LabCluster, RAY_CLI
from tools.ray_launch import tls_env

pytestmark = pytest.mark.timeout(1200)

PREFIX, NET = "spec-t5", 5
PROMPTS = 50  # × 4 ways of asking = 200 requests
MAX_TOKENS = 16
SEED = 2024
PARTITION_S = 20
IDLE_MINUTES = 0.5  # the lab's idle_timeout_minutes: a spare draft host idle this long goes back


@pytest.fixture(scope="module")
def cluster():
    if reason := lab_skip_reason(PREFIX):
        pytest.skip(reason)
    lab = HostLab(6, prefix=PREFIX, net=NET, home_links=LabCluster.HOME_LINKS).start()
    try:
        c = LabCluster(lab, targets=2, drafts=1, spare_drafts=1, idle_timeout_minutes=IDLE_MINUTES)
        t0 = time.monotonic()
        up = c.up()
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        c.wait_healthy(600)
        c.up_s = time.monotonic() - t0
        print(f"ray up to healthy: {c.up_s:.0f} s")
        yield c
        down = c.down()
        assert down.returncode == 0, down.stdout[-4000:] + down.stderr[-4000:]
        # `ray down` ran `ray stop` on the head in a login shell: it found the checkout's Ray on the PATH
        # the set-up commands gave that shell.
        assert "raylet" not in lab.ssh(c.head, "ps -eo comm").stdout
    finally:
        namespaces = net_namespace_ids(PREFIX)
        lab.close()
    # Nothing of the lab or of the Ray cluster on it is left: no namespace, link, directory or process.
    assert len(namespaces) == 6 and leftovers(PREFIX, namespaces) == []


def test_ray_up_places_each_role_on_its_hosts(cluster):
    nodes = cluster.node_hosts()
    started = [cluster.head, *cluster.targets, *cluster.drafts[:cluster.min_drafts]]  # the spare waits
    assert set(nodes) == {h.address for h in started}, nodes
    assert nodes[cluster.head.address].get("specserve_front") == 1
    for h in cluster.targets:
        assert nodes[h.address].get("specserve_target") == 1
    for h in cluster.drafts[:cluster.min_drafts]:
        assert nodes[h.address].get("specserve_draft") == 1
    actors = cluster.actor_hosts()
    ranks = actors["VerifierRankActor"]
    assert sorted(ranks) == sorted(h.address for h in cluster.targets), actors  # one rank on each target host
    assert set(actors["ServeReplica:specserve:DraftPool"]) <= {h.address for h in cluster.drafts}, actors
    assert set(actors["ProxyActor"]) == {cluster.head.address}, actors  # http.proxy_location: HeadOnly
    front = actors["ServeReplica:specserve:Router"] + actors["ServeReplica:specserve:OpenAIIngress"]
    assert set(front) == {cluster.head.address}, actors  # router.resources: the head's specserve_front


def _reference(cluster, prompt_ids: list[list[int]], sampled: bool) -> list[list[int]]:
    from deployments.settings import engine_settings
    from engine.assembly import make_engine
    from engine.engine import Request
    from runtime.models import load_tokenizer
    from runtime.protocol import SamplingParams

    tok = load_tokenizer(cluster.cfg.target.path)
    settings = dataclasses.replace(engine_settings(cluster.cfg), micro_batches=1)
    engine = make_engine(settings, eos_token_ids=[tok.eos_token_id])
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=SEED) if sampled else SamplingParams()
    return [list(o.tokens) for o in engine.generate([Request(tuple(p), max_tokens=MAX_TOKENS, sampling=sampling)
                                               for p in prompt_ids])]


def test_200_requests_match_the_in_process_engine(cluster):
    from evaluation.scenarios import load_prompts
    from runtime.models import load_tokenizer

    tok = load_tokenizer(cluster.cfg.target.path)
    prompts = [p["prompt"] for name in ("json", "code", "prose") for p in load_prompts(name, 17)][:PROMPTS]
    ids = [tok(p)["input_ids"] for p in prompts]
    want = {False: _reference(cluster, ids, sampled=False), True: _reference(cluster, ids, sampled=True)}
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=cluster.api_key, max_retries=0, timeout=120)

    def ask(job: tuple[int, bool, bool]) -> tuple[list[int] | str, str]:
        i, sampled, stream = job
        kw = dict(model=cluster.cfg.http.model_name, prompt=prompts[i], max_tokens=MAX_TOKENS,
                  temperature=1.0 if sampled else 0.0, **({"top_p": 0.9, "seed": SEED} if sampled else {}))
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)), "stream"
        r = client.completions.create(extra_body={"return_token_ids": True}, **kw)
        return r.choices[0].model_extra["token_ids"], "unary"

    jobs = [(i, sampled, stream) for i in range(PROMPTS) for sampled in (False, True) for stream in (False, True)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    elapsed = time.monotonic() - t0
    wrong = []
    for (i, sampled, stream), (got, _) in zip(jobs, answers):
        expected = want[sampled][i]
        if (tok.decode(expected, skip_special_tokens=True) if stream else expected) != got:
            wrong.append((i, sampled, stream, got, expected))
    _, stats = cluster.get("/debug/stats", timeout_s=30)  # the draft's fallbacks explain a seeded row that differs
    drafts = {k: stats.get(k) for k in ("fallback_reasons", "seeded_redrafts", "verifier_resyncs")}
    print(f"{len(jobs)} requests in {elapsed:.1f} s, {len(wrong)} differ; {drafts}")
    assert len(jobs) == 200 and not wrong, (drafts, wrong[:3])


def _from_outsider(cluster, command: str, timeout_s: float = 90):
    """``command`` in the outsider host's namespace, with the checkout's Ray and no token of the cluster's."""
    return cluster.lab.exec(cluster.outsiders[0], ["sh", "-c", command], timeout=timeout_s)


def test_an_outsider_reaches_the_ports_but_nothing_without_the_token_and_key(cluster, tmp_path):
    head = cluster.head.address
    probe = ("python3 -c \"import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); "
             "print('open')\"")
    assert "open" in _from_outsider(cluster, f"{probe} {head} 6379").stdout  # the GCS port answers...
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    tls = " ".join(tls_env().removeprefix("export ").split()).replace("$HOME/.ray/tls", str(cluster.tls_dir))
    # ...but a GCS attach is refused: in plaintext (Ray's TLS), and even with the cluster's own certificates
    # (as if stolen) without its token.
    # (A plaintext client retries its handshake for ~40 s before it gives up; each attempt is cut at 15 s,
    # by when an admitted client would have printed the status: a refused TLS client exits in ~2 s.)
    for env in ("RAY_AUTH_MODE=disabled", f"{tls} RAY_AUTH_MODE=disabled",
                f"{tls} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={wrong}"):
        t0 = time.monotonic()
        out = _from_outsider(cluster, f"{env} timeout 15 {RAY_CLI} status --address={head}:6379")
        print(f"outsider `ray status` with {env.replace(str(cluster.dir), '<lab>')}: exit {out.returncode} "
              f"after {time.monotonic() - t0:.1f} s")
        assert out.returncode != 0 and "specserve_target" not in out.stdout, out.stdout + out.stderr
    # The cluster's own client on the head, with the token and the certificates, is let in.
    # (the spare draft host may have joined already: the 200 requests can grow the pool)
    assert cluster.on_head("print(json.dumps(sum(n['Alive'] for n in ray.nodes())))") >= 1 + len(cluster.targets) + cluster.min_drafts
    # The dashboard (job submission, `serve deploy`) listens on the head's loopback only.
    assert "open" not in _from_outsider(cluster, f"{probe} {head} 8265").stdout
    serve_cli = RAY_CLI.replace("/ray", "/serve")
    out = _from_outsider(cluster, f"timeout 60 {serve_cli} deploy --address http://{head}:8265 "
                                  f"{cluster.dir / 'serve.yaml'}")
    assert out.returncode != 0
    # The HTTP API: open to the network, closed without the key.
    http = ("python3 -c \"import sys,urllib.request as u\n"
            "try: u.urlopen(u.Request(sys.argv[1])); print(200)\n"
            "except Exception as e: print(getattr(e, 'code', e))\"")
    assert _from_outsider(cluster, f"{http} {cluster.base_url}/v1/models").stdout.strip() == "401"
    assert cluster.get("/v1/models")[0] == 200


def test_cluster_hosts_listen_only_on_their_lab_address_and_loopback(cluster):
    for host in [cluster.head, *cluster.targets, *cluster.drafts]:
        out = cluster.lab.exec(host, ["ss", "-ltnH"])
        addrs = {line.split()[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")  # IPv4-mapped
                 for line in out.stdout.splitlines()}
        # A host's namespace has only its lab interface and loopback, so a wildcard means those two.
        assert addrs <= {host.address, "127.0.0.1", "0.0.0.0", "*", "::", "::1"}, (host, addrs)
        assert host.address in addrs


class Traffic:
    """Steady greedy requests from a few client threads while a fault plays out; each answer is checked
    against the in-process engine's (``want``)."""

    def __init__(self, cluster, prompts: list[str], want: list[list[int]], clients: int = 3, stream: bool = False):
        self.cluster, self.prompts, self.want, self.stream = cluster, prompts, want, stream
        self.tok = None
        if stream:
            from runtime.models import load_tokenizer

            self.tok = load_tokenizer(cluster.cfg.target.path)
        self.client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=cluster.api_key, max_retries=0,
                                    timeout=300)
        self.ok = self.wrong = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=330)

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            i = (i + len(self._threads)) % len(self.prompts)
            kw = dict(model=self.cluster.cfg.http.model_name, prompt=self.prompts[i], max_tokens=MAX_TOKENS,
                      temperature=0.0)
            try:
                if self.stream:  # an error mid-stream arrives as an SSE error event: the client raises it
                    got = "".join(c.choices[0].text for c in self.client.completions.create(stream=True, **kw))
                    want = self.tok.decode(self.want[i], skip_special_tokens=True)
                else:
                    got = self.client.completions.create(extra_body={"return_token_ids": True}, **kw) \
                        .choices[0].model_extra["token_ids"]
                    want = self.want[i]
            except openai.APIError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            if got == want:
                self.ok += 1
            else:
                self.wrong += 1


def _wait_status(cluster, wanted: set[str], timeout_s: float) -> float:
    """Seconds until /health's status is one of ``wanted``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            status, body = cluster.get("/health", timeout_s=5)  # the ingress answers 503 after 2 s at most
            if isinstance(body, dict) and body.get("status") in wanted:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"/health not {wanted} within {timeout_s} s: {cluster.get('/health')}")


@pytest.fixture(scope="module")
def steady(cluster):
    """Prompts and their in-process answers for the fault tests' traffic."""
    from evaluation.scenarios import load_prompts
    from runtime.models import load_tokenizer

    tok = load_tokenizer(cluster.cfg.target.path)
    prompts = [p["prompt"] for p in load_prompts("json", 12)]
    return prompts, _reference(cluster, [tok(p)["input_ids"] for p in prompts], sampled=False)


FAULTS: dict[str, dict[str, float]] = {}  # what each fault showed, printed at the end of the module


def _pool(cluster) -> tuple[int, set[str]]:
    """The draft pool's running replicas and the draft hosts in the cluster, as the head sees them."""
    return tuple(cluster.on_head(
        "from ray import serve\n"
        "d = serve.status().applications['specserve'].deployments['DraftPool']\n"
        f"drafts = {sorted(h.address for h in cluster.drafts)}\n"
        "hosts = [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] in drafts]\n"
        "print(json.dumps([d.replica_states.get('RUNNING', 0), hosts]))"))


def _wait_pool(cluster, replicas: int, hosts: int, timeout_s: float, log: list, *, at_least: bool = False) -> float:
    """Seconds until the pool runs ``replicas`` replicas (or more, ``at_least``) on ``hosts`` draft hosts;
    every change is logged."""
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout_s:
        running, up = _pool(cluster)
        if (running, len(up)) != last:
            last = (running, len(up))
            log.append((round(time.monotonic() - t0, 1), running, len(up)))
        if (running >= replicas if at_least else running == replicas) and len(up) == hosts:
            return time.monotonic() - t0
        time.sleep(2)
    raise TimeoutError(f"draft pool not at {replicas} replicas on {hosts} hosts in {timeout_s} s: {log}\n"
                       f"{cluster.diagnosis()}")


def test_the_draft_pool_scales_onto_a_spare_host_under_load_and_back_when_idle(cluster, steady):
    """A ramp of clients: Serve adds draft replicas as the parts in flight grow (draft_pool.batch_size rows
    per call), Ray's autoscaler starts the spare draft host over SSH when they no longer fit, and both go
    back once the load is gone. Every answer identical to the in-process engine's, none failed."""
    auto = cluster.cfg.draft_pool.autoscaling
    low = auto.min_replicas
    _wait_pool(cluster, low, cluster.min_drafts, 240, [])  # at rest after the 200 requests (they can grow it)
    up_log, down_log = [], []
    t0 = time.monotonic()
    # More replicas than one draft host holds (it advertises specserve_draft: 1): the spare host must join.
    beyond_one_host = int(1 / cluster.cfg.draft_pool.resources["specserve_draft"]) + 1
    with Traffic(cluster, *steady, clients=2) as few, Traffic(cluster, *steady, clients=10) as many:
        # 12 clients: three parts of two rows per micro-batch in flight
        up_s = _wait_pool(cluster, beyond_one_host, len(cluster.drafts), 300, up_log, at_least=True)
        placed = cluster.actor_hosts()["ServeReplica:specserve:DraftPool"]
        time.sleep(5)  # serve a while with the grown pool
    load_s = time.monotonic() - t0
    down_s = _wait_pool(cluster, low, cluster.min_drafts, 300, down_log)
    FAULTS["draft pool autoscaling"] = {
        "to_spare_host_s": round(up_s, 1), "up": up_log, "down_after_load_s": round(down_s, 1), "down": down_log,
        "requests": few.ok + many.ok, "wrong": few.wrong + many.wrong, "failed": len(few.errors + many.errors),
        "load_s": round(load_s, 1)}
    print(FAULTS)
    assert few.errors == many.errors == [] and few.wrong == many.wrong == 0 and few.ok + many.ok > 0
    # Each replica on a draft host, the spare among them (one host holds two)
    assert beyond_one_host <= len(placed) <= auto.max_replicas, placed
    assert set(placed) == {h.address for h in cluster.drafts}, placed


def _draft_hosts(cluster):
    """The draft hosts that hold the pool's replicas: a fault on all of them takes the whole pool away (the
    faults' light traffic can grow the pool onto the spare host, and a killed host's replacement replica may
    have started there)."""
    hosts = set(cluster.actor_hosts()["ServeReplica:specserve:DraftPool"])
    assert hosts, "the draft pool has no running replica"
    return [h for h in cluster.drafts if h.address in hosts]


def test_a_killed_draft_host_loses_no_request_and_the_pool_returns_with_the_host(cluster, steady):
    drafts = _draft_hosts(cluster)
    with Traffic(cluster, *steady) as traffic:
        time.sleep(5)
        for draft in drafts:
            cluster.lab.kill_host(draft)  # every process on it: its raylet, the draft replica, its sshd
        degraded = _wait_status(cluster, {"degraded"}, 60)
        time.sleep(10)
        for draft in drafts:
            cluster.lab.restart_sshd(draft)  # the host is back; Ray's autoscaler starts it again over SSH
        back = _wait_status(cluster, {"ok"}, 300) + degraded + 10
        time.sleep(5)
    FAULTS["draft host killed"] = {"degraded_after_s": round(degraded, 1), "ok_again_after_s": round(back, 1),
                                   "requests": traffic.ok, "wrong": traffic.wrong, "failed": len(traffic.errors)}
    print(FAULTS)
    assert traffic.errors == [] and traffic.wrong == 0 and traffic.ok > 0
    assert {h.address for h in cluster.drafts} & set(cluster.node_hosts())  # the pool has a host again


def test_b_a_partitioned_draft_host_loses_no_request_and_rejoins_after_the_heal(cluster, steady):
    drafts = _draft_hosts(cluster)
    with Traffic(cluster, *steady) as traffic:
        time.sleep(5)
        for draft in drafts:
            cluster.lab.link_down(draft)  # its processes live on, cut off from the rest of the cluster
        degraded = _wait_status(cluster, {"degraded"}, 60)
        time.sleep(max(0.0, PARTITION_S - degraded))
        for draft in drafts:
            cluster.lab.link_up(draft)
        back = _wait_status(cluster, {"ok"}, 300) + PARTITION_S
        time.sleep(5)
    FAULTS["draft host partitioned"] = {"degraded_after_s": round(degraded, 1), "partition_s": PARTITION_S,
                                        "ok_again_after_s": round(back, 1), "requests": traffic.ok,
                                        "wrong": traffic.wrong, "failed": len(traffic.errors)}
    print(FAULTS)
    # Every answer whole and identical to the in-process engine's: no token lost or repeated across the heal.
    assert traffic.errors == [] and traffic.wrong == 0 and traffic.ok > 0
    assert {d.address for d in drafts} <= set(cluster.node_hosts())
    assert set(cluster.actor_hosts()["ServeReplica:specserve:DraftPool"]) <= {h.address for h in cluster.drafts}


def test_c_a_killed_target_host_ends_streams_cleanly_and_the_group_is_rebuilt_when_it_returns(cluster, steady):
    target = cluster.targets[1]
    with Traffic(cluster, *steady, stream=True) as traffic:
        time.sleep(5)
        cluster.lab.kill_host(target)  # a verifier rank's host, mid-stream
        down = _wait_status(cluster, {"degraded", "unhealthy"}, 90)
        time.sleep(10)
        cluster.lab.restart_sshd(target)
        back = _wait_status(cluster, {"ok"}, 400) + down + 10
        time.sleep(5)
    FAULTS["target host killed"] = {"not_ok_after_s": round(down, 1), "ok_again_after_s": round(back, 1),
                                    "streams": traffic.ok, "wrong": traffic.wrong, "ended_with_error": len(traffic.errors)}
    print(FAULTS, traffic.errors[:3])
    assert traffic.wrong == 0 and traffic.ok > 0  # every stream identical, or ended with an explicit error
    # The verifier's replica pings its ranks with the router's probe: /health turns at once, not when Ray
    # declares the rank dead (tens of seconds).
    assert down <= 2
    assert sorted(cluster.actor_hosts()["VerifierRankActor"]) == sorted(h.address for h in cluster.targets)
