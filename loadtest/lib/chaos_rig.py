"""The chaos bench's rig (loadtest/chaos.py): a throwaway PostgreSQL cluster that can be
restarted, replica processes that can be SIGKILLed and restarted on their port, and a TCP proxy
in front of each replica that cuts client connections mid-request.

Kept apart from the bench's script so each piece reads alone; nothing here knows about jobs.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.lib.common import ROOT, child_env, free_port

PG_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
_TAKEN: set[int] = set()


def new_port() -> int:
    """A free port none of this rig's pieces has: ``free_port`` alone may hand out one port
    twice before either is bound (a replica binds only once its model is loaded)."""
    while (port := free_port()) in _TAKEN:
        pass
    _TAKEN.add(port)
    return port


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the Debian package's user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass
class Postgres:
    """A cluster of its own (data directory, port, socket folder; trust auth, fsync off: it
    dies with the bench)."""

    root: Path
    port: int = field(default_factory=new_port)
    restarts: int = 0

    @property
    def bindir(self) -> Path:
        if not PG_BINS:
            raise SystemExit("PostgreSQL not found (/usr/lib/postgresql/*/bin): apt-get install "
                             "postgresql")
        return Path(PG_BINS[-1]).parent

    def _run(self, *args: object) -> None:
        subprocess.run(_as_postgres([str(a) for a in args]), check=True, capture_output=True,
                       text=True, timeout=120)

    def start(self) -> Postgres:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("mkdir", "-p", self.root / "sock")
        self._run(self.bindir / "initdb", "-D", self.root / "data", "-U", "postgres",
                  "--auth=trust", "-E", "UTF8")
        self._pg_ctl("start")
        return self

    def _pg_ctl(self, action: str, *extra: str) -> None:
        opts = (f"-p {self.port} -k {self.root / 'sock'} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c max_connections=300")
        self._run(self.bindir / "pg_ctl", "-D", self.root / "data", "-l", self.root / "server.log",
                  "-o", opts, "-w", "-t", "60", *extra, action)

    def restart(self) -> None:
        """A fast restart (open connections are cut), as an operator's or a failover's."""
        self._pg_ctl("restart", "-m", "fast")
        self.restarts += 1

    def stop(self) -> None:
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"),
                                     "-m", "immediate", "stop"]), capture_output=True, timeout=60)

    def create_db(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"


@dataclass
class Replica:
    """One ``python -m app`` process; :meth:`kill` is SIGKILL, :meth:`start` again takes the
    same port and replica id (a container restarted in its pod)."""

    name: str
    data_dir: Path
    env: dict[str, str]
    port: int = field(default_factory=new_port)
    proc: subprocess.Popen[bytes] | None = None
    lives: list[Path] = field(default_factory=list)  # one log per life
    kills: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True, timeout: float = 300.0) -> None:
        log = self.data_dir / f"{self.name}-{len(self.lives)}.log"
        self.lives.append(log)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = child_env(extra={**self.env, "BATCHSCRIBE_PORT": str(self.port),
                               "BATCHSCRIBE_STORAGE__REPLICA_ID": self.name,
                               "BATCHSCRIBE_STORAGE__DATA_DIR": str(self.data_dir)})
        with log.open("wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env,
                                         stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while wait and not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name} did not start:\n"
                                 + log.read_text(errors="replace")[-3000:])
            time.sleep(0.25)

    def ready(self) -> bool:
        """This life answers: its own log says it listens on its port (tests/conftest.py's
        Server says why a readiness answer alone is not enough), and ``/readyz`` is 200."""
        import httpx

        if self.proc is None or self.proc.poll() is not None or not self.lives or \
                f"running on {self.url} " not in self.lives[-1].read_text(errors="replace"):
            return False
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self.kills += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


class CuttingProxy:
    """TCP in front of a replica; a ``rate`` of client connections is cut (both sides aborted)
    at a random byte: mid-request (an upload cut off) or mid-response (the job made, its answer
    lost), which a client with retries must survive without duplicates. Runs on its own
    thread's event loop."""

    def __init__(self, upstream_port: int, rate: float, seed: int) -> None:
        self.upstream_port, self.rate = upstream_port, rate
        self.port = new_port()
        self.rng = random.Random(seed)
        self.connections = self.cut_requests = self.cut_responses = self.refused = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, name=f"proxy-{self.port}", daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        # A cut lands at a random byte of the connection's stream (a kept-alive connection
        # carries many requests: this one's uploads, or its answers), if it gets that far.
        cut = self.rng.random() < self.rate
        up_at = self.rng.randint(200, 150_000) if cut and self.rng.random() < 0.67 else None
        down_at = self.rng.randint(20, 4_000) if cut and up_at is None else None
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the replica is down: as a client sees a dead pod
            self.refused += 1
            writer.transport.abort()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       limit: int | None) -> bool:
            sent = 0
            while data := await src.read(65536):
                if limit is not None and sent + len(data) >= limit:
                    dst.write(data[: limit - sent])
                    return True  # cut here
                dst.write(data)
                await dst.drain()
                sent += len(data)
            return False

        tasks = [asyncio.ensure_future(pump(reader, uwriter, up_at)),
                 asyncio.ensure_future(pump(ureader, writer, down_at))]
        cutting = False
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if not t.cancelled() and t.exception() is None and t.result():
                    cutting = True
                    if t is tasks[0]:
                        self.cut_requests += 1
                    else:
                        self.cut_responses += 1
        finally:
            for t in tasks:
                t.cancel()
            for w in (writer, uwriter):
                if cutting:
                    w.transport.abort()  # a reset, mid-message
                else:
                    w.close()  # one side ended: what is buffered still goes out
