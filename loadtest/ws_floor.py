"""What one live append costs the service's event loop in uvicorn's WebSocket protocol alone.

    python -m loadtest.ws_floor --clients 32 --seconds 20 --runs 3 --out loadtest/results/ws-floor.json

An ASGI app that reads every message and does nothing with it, served as ``python -m app``
serves the service (``app.__main__.server_config``: the same WebSocket protocol class), takes
``--clients`` WebSocket clients (websockets, as ``loadtest/live.py``'s) each sending a
``input_audio_buffer.append`` of 100 ms of 24 kHz PCM16 (6.4 KB of base64 JSON) ten times a
second. Per run: the server process's CPU per message, with the client's permessage-deflate
offer declined and accepted, in turns (``--runs`` each). What a live session costs on the loop
beyond this is the session's own work (``loadtest/live_capacity.py``, the loop's thread at
``/proc``); this is the part no change to the session can take away.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.lib.common import ROOT, free_port, machine_info

PAYLOAD = json.dumps({"type": "input_audio_buffer.append",
                      "audio": base64.b64encode(os.urandom(4800)).decode()})


def serve(port: int, deflate: bool) -> None:
    """The server side (a process of its own): the app reads and drops every message."""
    import uvicorn

    from app.__main__ import server_config
    from app.config import Settings

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (await receive())["type"] == "websocket.receive":
            pass

    settings = Settings.model_construct()
    settings.live.per_message_deflate = deflate
    uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port,
                                 log_level="warning")).run()


async def clients(url: str, n: int, seconds: float) -> int:
    """``n`` clients at 10 appends a second each, spread over the 100 ms; messages sent."""
    from websockets.asyncio.client import connect

    async def one(k: int) -> int:
        async with connect(url, max_size=None) as ws:
            t0, sent = time.monotonic() + k * 0.1 / n, 0
            while sent < seconds * 10:
                await asyncio.sleep(max(0.0, t0 + sent * 0.1 - time.monotonic()))
                await ws.send(PAYLOAD)
                sent += 1
            return sent

    return sum(await asyncio.gather(*(one(k) for k in range(n))))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(deflate: bool, n: int, seconds: float) -> dict[str, Any]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.ws_floor", "--serve", str(port),
                             *(["--deflate"] if deflate else [])], cwd=ROOT)
    try:
        url = f"ws://127.0.0.1:{port}/"
        deadline = time.monotonic() + 60
        while True:  # up once it takes a connection
            try:
                asyncio.run(clients(url, 1, 0.1))
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        c0 = cpu_s(proc.pid)
        sent = asyncio.run(clients(url, n, seconds))
        used = cpu_s(proc.pid) - c0
    finally:
        proc.terminate()
        proc.wait(30)
    return {"deflate": deflate, "clients": n, "messages": sent, "server_cpu_s": round(used, 2),
            "us_per_message": round(used / sent * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3, help="runs each way, in turns")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "ws-floor.json")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--deflate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.deflate)
        return 0
    report: dict[str, Any] = {
        "command": "python -m loadtest.ws_floor " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "message_bytes": len(PAYLOAD), "runs": []}
    for _ in range(args.runs):
        for deflate in (False, True):
            report["runs"].append(one_run(deflate, args.clients, args.seconds))
            print(json.dumps(report["runs"][-1]), flush=True)
    for deflate in (False, True):
        got = sorted(r["us_per_message"] for r in report["runs"] if r["deflate"] is deflate)
        report["deflate" if deflate else "plain"] = {"min_us": got[0], "max_us": got[-1],
                                                     "median_us": got[len(got) // 2]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"ws_floor: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
