"""HTTP load for the reliability suite (``tests/ray/test_reliability_*.py``) and ``scripts/soak.py``.

A small HTTP/1.1 client on asyncio streams — standard library only, no Ray, no torch — because a
reliability ledger needs what ordinary clients hide: one connection per request with its own timings
(first byte, last byte, the longest wait between two server-sent events), events parsed as they arrive,
a client that hangs up after N events, and exact control of the bytes sent. The process helpers at the
end (``replica_pid``, ``listening_sockets``, ``off_loopback``) find a local server's replicas to kill and
its sockets, and the sockets that listen beyond loopback (by ``cluster.config.is_loopback_host``).

    target = Target.parse("http://127.0.0.1:8000")
    results = await steady(target, bodies, rate=20.0)        # open-loop arrivals, one every 1/rate s
    results = await burst(target, bodies)                    # all at once (overload)
    results = await hang_ups(target, stream_bodies, after_events=2)   # clients that leave mid-stream
    async with stalled_bodies(target, 300): ...              # slow clients: half a body, then nothing
    async with HealthWatch(target) as watch: ...             # /health sampled in the background
    ledger = Ledger(); ledger.add("steady", results, references); print(ledger.table())

Every result gets one ``kind``: ``ok`` (a complete answer: a JSON body with a finish reason, or a stream
that carried a finish reason and ended with ``[DONE]``), ``stream_error`` (a stream that ended with an
explicit ``{"error": ...}`` event), ``truncated`` (a 200 that ended any other way: the silent failure
the suite exists to catch), ``rejected`` (503/429), ``client_error`` (other 4xx), ``server_error``
(other 5xx), ``hung_up`` (this client left on purpose) or ``transport`` (no response at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

from cluster.config import is_loopback_host

KINDS = ("ok", "stream_error", "truncated", "rejected", "client_error", "server_error", "hung_up", "transport")


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    prefix: str = ""  # the app's route prefix, e.g. "/oa"
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> "Target":
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host:port[/prefix] URL, got {url!r}")
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"), api_key)


@dataclass
class Result:
    status: int | None = None  # None: no response line (refused, reset, timed out before it)
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""  # the de-chunked body as received
    events: list = field(default_factory=list)  # server-sent event payloads: parsed JSON, or "[DONE]"
    started: float = 0.0  # time.monotonic() when the request was on the wire (connected), or when it began
    connect_s: float | None = None  # from the call to the connection being established
    latency_s: float | None = None  # until the last byte (or the failure)
    max_gap_s: float = 0.0  # longest wait between two events of a stream (from the first byte)
    error: str | None = None  # transport failure, if any
    hung_up: bool = False

    @property
    def streamed(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def kind(self) -> str:
        if self.hung_up:
            return "hung_up"
        if self.status is None:
            return "transport"
        if self.status in (429, 503):
            return "rejected"
        if 400 <= self.status < 500:
            return "client_error"
        if self.status >= 500:
            return "server_error"
        if self.streamed:
            if any(isinstance(e, dict) and "error" in e for e in self.events):
                return "stream_error"
            done = bool(self.events) and self.events[-1] == "[DONE]"
            return "ok" if done and self.finish_reason is not None else "truncated"
        return "ok" if self.error is None and self.finish_reason is not None else "truncated"

    @property
    def choices(self) -> list[dict]:
        if self.streamed:
            return [c for e in self.events if isinstance(e, dict) for c in e.get("choices") or ()]
        body = self.json
        return list(body.get("choices") or ()) if isinstance(body, dict) else []

    @property
    def finish_reason(self) -> str | None:
        return next((c["finish_reason"] for c in reversed(self.choices) if c.get("finish_reason")), None)

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids (the request must set ``return_token_ids``)."""
        return [t for c in self.choices for t in c.get("token_ids") or ()]

    @property
    def text(self) -> str:
        parts = []
        for c in self.choices:
            parts.append(c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def error_body(self) -> dict | None:
        """The OpenAI-shaped ``error`` object of an error status or a stream's error event."""
        found = [e for e in self.events if isinstance(e, dict) and "error" in e]
        body = found[-1] if found else self.json
        return body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None


def encode_body(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def request(target: Target, method: str, path: str, body: Any = None, *, timeout: float = 120.0,
                  hang_up_after: int | None = None, headers: dict[str, str] | None = None) -> Result:
    """One request on its own connection. ``body``: a JSON-able value or raw bytes. ``hang_up_after``:
    close the connection after that many server-sent events (a client that goes away)."""
    res = Result(started=time.monotonic())
    payload = b"" if body is None else encode_body(body)
    head = [f"{method} {target.prefix}{path} HTTP/1.1", f"Host: {target.host}:{target.port}",
            "Connection: close", "Accept: */*", f"Content-Length: {len(payload)}"]
    if body is not None:
        head.append("Content-Type: application/json")
    if target.api_key:
        head.append(f"Authorization: Bearer {target.api_key}")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(target.host, target.port)
            # The clock starts with the request on the wire: how long this process's own event loop took to
            # get to it (hundreds of connections opened at once, its GC) is not the server's latency. The
            # server's accept and everything after it still count.
            res.connect_s, res.started = time.monotonic() - res.started, time.monotonic()
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
            await writer.drain()
            await _read_response(reader, res, hang_up_after)
    except TimeoutError:
        res.error = f"no complete answer within {timeout:g} s"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.latency_s = time.monotonic() - res.started
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    return res


async def _read_response(reader: asyncio.StreamReader, res: Result, hang_up_after: int | None) -> None:
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection before answering")
    res.status = int(line.split()[1])
    while (line := await reader.readline()) not in (b"\r\n", b"\n"):
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        name, _, value = line.decode("latin-1").partition(":")
        res.headers[name.strip().lower()] = value.strip()
    body = bytearray()
    pending = b""
    last_event = time.monotonic()
    async for piece in _pieces(reader, res.headers):
        body += piece
        if not res.streamed:
            continue
        pending += piece
        while b"\n\n" in pending:
            block, pending = pending.split(b"\n\n", 1)
            for text in block.decode("utf-8", "replace").splitlines():
                if text.startswith("data: "):
                    data = text[len("data: "):]
                    res.events.append(data if data == "[DONE]" else _loads(data))
                    now = time.monotonic()
                    res.max_gap_s = max(res.max_gap_s, now - last_event)
                    last_event = now
            if hang_up_after is not None and len(res.events) >= hang_up_after:
                res.hung_up = True
                res.body = bytes(body)
                return
    res.body = bytes(body)


def _loads(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return {"unparsable": data}


async def _pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise asyncio.IncompleteReadError(b"", None)  # closed mid-body: a truncated answer
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        n = int(headers["content-length"])
        if n:
            yield await reader.readexactly(n)
    else:
        while piece := await reader.read(65536):
            yield piece


# -- traffic shapes ----------------------------------------------------------------------------------


async def steady(target: Target, bodies: Sequence[Any], rate: float, *, path: str = "/v1/completions",
                 timeout: float = 120.0) -> list[Result]:
    """Open-loop arrivals: request ``i`` starts at ``i / rate`` s whatever the earlier ones are doing
    (a closed loop would slow down with the server and never overload it)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks = []
    for i, body in enumerate(bodies):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(request(target, "POST", path, body, timeout=timeout)))
    return list(await asyncio.gather(*tasks))


async def burst(target: Target, bodies: Sequence[Any], *, path: str = "/v1/completions", timeout: float = 120.0,
                concurrency: int | None = None) -> list[Result]:
    """All requests at once, or at most ``concurrency`` in flight (a closed loop of that many clients)."""
    gate = asyncio.Semaphore(concurrency or max(1, len(bodies)))

    async def one(body):
        async with gate:
            return await request(target, "POST", path, body, timeout=timeout)

    return list(await asyncio.gather(*(one(b) for b in bodies)))


async def hang_ups(target: Target, bodies: Sequence[Any], after_events: int = 2, *,
                   path: str = "/v1/completions") -> list[Result]:
    """Streaming requests whose clients close the connection after ``after_events`` events."""
    return list(await asyncio.gather(*(request(target, "POST", path, b, hang_up_after=after_events)
                                       for b in bodies)))


@contextlib.asynccontextmanager
async def stalled_bodies(target: Target, n: int, *, path: str = "/v1/completions", declared: int = 4096):
    """Hold ``n`` connections that send a request's headers and half its declared body, then stall (slow
    clients); yields how many the server accepted. Closed on exit."""
    head = (f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n"
            + (f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else "") + "\r\n").encode()
    writers = []
    try:
        for _ in range(n):
            try:
                _, writer = await asyncio.open_connection(target.host, target.port)
            except OSError:
                break
            writer.write(head + b"{" + b" " * (declared // 2))
            writers.append(writer)
        await asyncio.gather(*(w.drain() for w in writers), return_exceptions=True)
        yield len(writers)
    finally:
        for writer in writers:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)


async def get_json(target: Target, path: str, timeout: float = 10.0) -> tuple[int | None, Any]:
    res = await request(target, "GET", path, timeout=timeout)
    return res.status, res.json


class HealthWatch:
    """Samples ``GET /health`` every ``interval_s`` in the background: ``samples`` holds
    (monotonic time the answer arrived, HTTP status or None, the body's ``status``, seconds it took)."""

    def __init__(self, target: Target, interval_s: float = 0.1, timeout_s: float = 5.0):
        self.target, self.interval_s, self.timeout_s = target, interval_s, timeout_s
        self.samples: list[tuple[float, int | None, str | None, float]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "HealthWatch":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            res = await request(self.target, "GET", "/health", timeout=self.timeout_s)
            body = res.json if isinstance(res.json, dict) else {}
            self.samples.append((time.monotonic(), res.status, body.get("status"), res.latency_s))
            await asyncio.sleep(self.interval_s)

    def first(self, status: str, after: float) -> float | None:
        """Seconds from ``after`` to the first sample whose body says ``status``, or None."""
        return next((t - after for t, _, s, _ in self.samples if t >= after and s == status), None)

    async def wait_for(self, status: str, after: float, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while (found := self.first(status, after)) is None and time.monotonic() < deadline:
            await asyncio.sleep(self.interval_s / 2)
        return found


# -- a local server's processes (psutil, imported on use) ---------------------------------------------


def replica_pid(root_pid: int, app_name: str, deployment: str) -> int:
    """The process of ``deployment``'s one replica under ``root_pid`` (a Ray cluster this process tree
    started): Ray titles it ``ray::ServeReplica:<app>:<deployment>``."""
    tag = f"ServeReplica:{app_name}:{deployment}"
    found = [pid for pid, cmd in process_tree(root_pid).items() if tag in cmd]
    if len(found) != 1:
        raise LookupError(f"expected one {tag} process under pid {root_pid}, found {found}")
    return found[0]


def process_tree(root_pid: int) -> dict[int, str]:
    """pid → command line of ``root_pid`` and all its descendants."""
    import psutil

    root = psutil.Process(root_pid)
    out = {}
    for proc in (root, *root.children(recursive=True)):
        try:
            out[proc.pid] = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
    return out


def listening_sockets(root_pid: int) -> list[tuple[str, int, str]]:
    """(address, port, command) of every listening TCP socket of the process tree under ``root_pid``."""
    import psutil

    tree = process_tree(root_pid)
    return sorted((c.laddr.ip, c.laddr.port, tree[c.pid][:80]) for c in psutil.net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN and c.pid in tree)


def off_loopback(sockets: Iterable[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The rows of ``listening_sockets`` whose address is not loopback by ``cluster.config.is_loopback_host``
    (127.0.0.0/8, ::1, and IPv4-mapped ``::ffff:127.x``: a dual-stack socket bound to 127.0.0.1)."""
    return [row for row in sockets if not is_loopback_host(row[0])]


# -- the ledger ----------------------------------------------------------------------------------------


def pct(values, q: float) -> float:
    """The q-th percentile (0-100) of values by nearest rank; NaN for none."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Ledger:
    """Outcome counts per scenario, as a table and as JSON. ``add`` classifies results (and, given the
    expected token ids per result, counts the complete ones that differ); ``note`` records other figures."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, scenario: str, results: Sequence[Result], expected: Sequence[list[int]] | None = None,
            **notes) -> dict:
        row = self.rows.setdefault(scenario, {"requests": 0, **{k: 0 for k in KINDS}, "identical": 0,
                                              "mismatched": 0, "latencies": [], "notes": {}})
        kinds = Counter(r.kind for r in results)
        row["requests"] += len(results)
        for k in KINDS:
            row[k] += kinds[k]
        if expected is not None:
            for r, want in zip(results, expected, strict=True):
                if r.kind == "ok":
                    row["identical" if r.token_ids == list(want) else "mismatched"] += 1
        row["latencies"] += [r.latency_s for r in results if r.kind == "ok" and r.latency_s is not None]
        row["notes"].update(notes)
        return self.as_dict()[scenario]

    def note(self, scenario: str, **notes) -> None:
        self.add(scenario, [], **notes)

    def as_dict(self) -> dict:
        out = {}
        for name, row in self.rows.items():
            lat = sorted(row["latencies"])
            out[name] = {k: v for k, v in row.items() if k != "latencies"}
            out[name]["notes"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in row["notes"].items()}
            out[name]["latency_p50_s"] = round(statistics.median(lat), 4) if lat else None
            out[name]["latency_p99_s"] = round(pct(lat, 99), 4) if lat else None
        return out

    def table(self) -> str:
        cols = ["requests", *KINDS, "identical", "mismatched", "latency_p50_s", "latency_p99_s"]
        rows = self.as_dict()
        width = max([len("scenario"), *map(len, rows)])
        lines = [" ".join([f"{'scenario':<{width}}", *(f"{c:>{max(len(c), 6)}}" for c in cols), " notes"])]
        for name, row in rows.items():
            cells = [f"{'-' if row[c] is None else row[c]:>{max(len(c), 6)}}" for c in cols]
            notes = ", ".join(f"{k}={v}" for k, v in row["notes"].items())
            lines.append(" ".join([f"{name:<{width}}", *cells, " " + notes]))
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, log_dir: Path, env: dict[str, str] | None = None, *,
                 timeout_s: float = 300.0) -> tuple[subprocess.Popen, Target]:
    """``specserve serve --config CONFIG`` on a free loopback port, in its own process group (so
    ``stop_server`` can end the whole tree), returned once ``/health`` answers 200. A second Ray cluster on
    a loaded 2-core box can miss Ray's fixed 30 s raylet start window: that start is retried once. Logs go
    to ``log_dir/serve-N.log``."""
    for attempt in (1, 2):
        port, log = free_port(), log_dir / f"serve-{attempt}.log"
        with open(log, "wb") as out:
            server = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--config", str(config),
                                       "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        target, deadline = Target("127.0.0.1", port), time.monotonic() + timeout_s
        while server.poll() is None and time.monotonic() < deadline:
            if asyncio.run(get_json(target, "/health", timeout=5))[0] == 200:
                return server, target
            time.sleep(1.0)
        stop_server(server)
        text = log.read_text(errors="replace")
        if attempt == 2 or "timed out during startup" not in text:
            raise RuntimeError(f"specserve serve did not become healthy (exit {server.returncode}); "
                               f"{log}:\n{text[-3000:]}")
    raise AssertionError("unreachable")


def stop_server(server: subprocess.Popen) -> None:
    """Stop a `specserve serve` started in its own session: SIGINT (it drains and shuts Ray down), then kill."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)  # serve_forever drains and shuts its Ray cluster down
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # its own process group (start_new_session)
            server.wait(10)
