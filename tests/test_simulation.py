"""The scheduler's latency bound, checked on the real owner and policy in a deterministic
discrete-event simulation (tests/simulation.py: simulated clock, engine calls costed from this
host's traces). Issue 48: no latency-critical window (a short upload, a live final) waits for
more than one engine call of bounded cost, whatever bulk work is running.

The short-request bench of loadtest/stall.py, simulated: a 20-minute meeting-like upload
(windows of 26-29.5 s) kept in flight, one client sending short clips one at a time, n = 100,
latency counted from each submit plus 0.3 s for what happens outside the batcher. Every number
here is simulated seconds: the wall-clock benches (commands in the report) check them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from app.batching.stages import Item
from app.config import BatcherSettings
from tests.simulation import (
    SHORT_CLIPS,
    Costs,
    KeptUpload,
    LiveSession,
    ShortClient,
    Sim,
    blocked,
    meeting,
    offline_rate,
    percentile,
)

BUDGET = BatcherSettings().batch_cost_s
LONG_CLIPS = (12.0, 18.5, 22.0, 4.0, 9.0, 21.0, 16.0, 25.0)  # some in the upload's padded class


def looping(i: Item) -> bool:
    """One short clip in 20, and one upload window in 40, decodes into a loop or unsure text
    and asks for the 30 s fallback (3 of the corpus's 83 clips do on this host)."""
    n = int(i.job_id.rsplit("-", 1)[1]) if i.job_id.startswith("short-") else i.rank
    return n % (20 if i.job_id.startswith("short-") else 40) == 7


def stall(workers: int, staged: bool, scale: float, clips: Sequence[float], minutes: float = 20.0
          ) -> tuple[Sim, ShortClient, ShortClient, KeptUpload]:
    settings = BatcherSettings()
    idle = Sim(settings, workers, staged, Costs(scale=scale), loops=looping)
    alone = ShortClient(idle, 100, clips=clips)
    idle.run()
    sim = Sim(settings, workers, staged, Costs(scale=scale), loops=looping)
    kept = KeptUpload(sim, meeting(minutes))
    beside = ShortClient(sim, 100, start=10.0, clips=clips)  # the upload's first calls measured
    sim.run(until=2000,
            done=lambda: len(beside.latency) == 100 and kept.uploads[0].done_at is not None)
    assert len(beside.latency) == 100 and kept.uploads[0].done_at is not None
    return sim, alone, beside, kept


CONFIGS = {  # workers, two stages
    "cpu": (2, True),  # the service on this host: a worker reserved from bulk
    "one-worker": (1, True),  # nothing to reserve: bulk calls cut to the budget
    "gpu-like": (2, False),  # one stage, no reserve
    "one-gpu-worker": (1, False),
}


@pytest.mark.parametrize("clips", [SHORT_CLIPS, LONG_CLIPS], ids=["short-clips", "long-clips"])
@pytest.mark.parametrize("scale", [1.0, 1.5], ids=["this-host", "slower-host"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_critical_window_waits_for_at_most_one_bounded_call(
        config: str, scale: float, clips: Sequence[float]) -> None:
    sim, *_ = stall(*CONFIGS[config], scale, clips)
    shorts = [(k, r) for k, r in sim.records.items() if r.critical and r.submitted >= 10.0]
    assert len(shorts) == 100
    waits = [blocked(sim, r, k) for k, r in shorts]
    # No short window spent longer than one bounded call outside its own engine calls. Where
    # no worker is reserved from bulk, that is because the bulk calls beside them ran within
    # the budget (as estimated from the calls before: 10 % of slack for the estimate).
    assert max(waits) <= BUDGET, sorted(waits)[-5:]
    first, last = 10.0, max(r.answered or 0.0 for _, r in shorts)
    beside_them = [e - s for s, e, c in sim.calls if c.bulk and first <= s <= last]
    reserved = CONFIGS[config] == (2, True)
    assert reserved or max(beside_them) <= 1.1 * BUDGET


@pytest.mark.parametrize("minutes", [20.0, 3.5], ids=["20-minute", "few-window"])
@pytest.mark.parametrize("clips", [SHORT_CLIPS, LONG_CLIPS], ids=["short-clips", "long-clips"])
@pytest.mark.parametrize("scale", [1.0, 1.5], ids=["this-host", "slower-host"])
def test_the_stall_bench_targets_hold_on_the_service_as_configured(
        scale: float, clips: Sequence[float], minutes: float) -> None:
    """Two workers of one thread, two stages (the service's CPU defaults): p95 <= 3x idle p95,
    max <= 5x idle p95, over the whole upload's progress, beside 20-minute uploads and beside
    3.5-minute ones (7-8 windows: not bulk, they go through the decoder pool). The long clips
    put short requests in the upload's padded class, where the decoder pool once held them ~6 s
    for the upload's windows (app/batching/pool.py): max 7.4-7.9 s against 1.4-1.9 s idle beside
    the 20-minute upload, p95 4.7-5.8x idle beside the 3.5-minute ones."""
    _, alone, beside, kept = stall(2, True, scale, clips, minutes)
    idle_p95 = percentile([lat for _, lat in alone.latency], 0.95)
    lat = [lat for _, lat in beside.latency]
    assert percentile(lat, 0.95) <= 3 * idle_p95 and max(lat) <= 5 * idle_p95
    # Spread over the upload: requests ran beside every part of at least one whole upload.
    progress = sorted(kept.progress(t) % 1 for t, _ in beside.latency)
    assert progress[0] < 0.1 and (progress[-1] > 0.9 or minutes < 20)


def test_the_upload_keeps_its_pace_beside_short_requests() -> None:
    """The reserve costs the upload one worker of two while short requests come; nothing else:
    beside the client it runs at least half its speed alone (the bound never shrinks its calls
    on this configuration)."""
    sim, _, _, kept = stall(2, True, 1.0, SHORT_CLIPS)
    first = kept.uploads[0]
    assert first.done_at is not None
    alone = Sim(BatcherSettings(), 2, True, Costs())
    up = KeptUpload(alone, meeting())
    alone.run(until=2000, done=lambda: up.uploads[0].done_at is not None)
    assert up.uploads[0].done_at is not None
    assert first.done_at <= 2 * up.uploads[0].done_at
    assert all(len(c.items) >= 1 for _, _, c in sim.calls if c.bulk)


def live(beside: bool, scale: float) -> tuple[list[tuple[float, float, bool]], int]:
    sim = Sim(BatcherSettings(), 2, True, Costs(scale=scale))
    rng = np.random.default_rng(7)
    sessions = []
    for k in range(16):
        turns: list[float] = []
        while sum(turns) + 1.2 * len(turns) < 90:
            turns.append(float(rng.uniform(5, 15)))  # long read-speech turns
        sessions.append(LiveSession(sim, f"s{k}", turns, start=k * 0.37))
    if beside:
        KeptUpload(sim, meeting())
    sim.run(until=150)
    return [r for s in sessions for r in s.results], sum(len(s.turns) for s in sessions)


@pytest.mark.parametrize("scale", [1.0, 1.5], ids=["this-host", "slower-host"])
def test_live_finals_beside_an_upload(scale: float) -> None:
    """16 sessions of 5-15 s turns: every turn completed, alone and beside a kept upload, and
    the upload costs the finals little (its calls keep to a quarter of one worker beside live
    sessions). Simulated at this host's costs: turn p95 1.54 s alone, 1.53 s beside, interim
    text on 99-100 % of turns; at the slower host's: 2.31 s both, 80 % and 72 %: the 16 streams
    keep the engine 96 % busy, so the p95 <= 1.5 s target is the engine's speed, not the order."""
    results = {}
    for b in (False, True):
        done, turns = live(b, scale)
        assert len(done) == turns  # every turn completed
        lat = [r[1] for r in done]
        long = [r for r in done if r[0] >= 4]
        results[b] = (percentile(lat, 0.95), sum(r[2] for r in long) / len(long))
    (alone_p95, alone_cover), (beside_p95, beside_cover) = results[False], results[True]
    assert beside_p95 <= alone_p95 + 0.25
    assert beside_cover >= alone_cover - 0.10
    if scale == 1.0:
        assert alone_cover >= 0.8 and beside_cover >= 0.8


def test_32_short_clients_keep_the_engine_at_its_offline_rate() -> None:
    """The bench's load (loadtest/bench.py: 32 clients, each posting its next clip 0.3 s after
    its last answer) costs the policy no throughput: the engine stays busy and the service's
    rate is within 5 % of the same clips run offline in sorted batches of the cap, the bench's
    engine limit. Simulated: 0.985 of it, the engine busy 99 % (two stages, decoder batches
    mostly 8-16). So where the wall-clock bench reads lower, the CPU the engine did not get
    (HTTP, prep, the event loop) is the cause, not the order the batcher runs windows in."""
    settings = BatcherSettings()
    costs = Costs()
    sim = Sim(settings, 2, True, costs)
    clients = [ShortClient(sim, 10**6, start=0.05 * k, name=f"client{k}") for k in range(32)]
    until = 300.0
    sim.run(until=until)
    audio = sum(c.clips[k % len(c.clips)] for c in clients for k in range(len(c.latency)))
    busy = sum(end - start for start, end, _ in sim.calls) / (2 * until)
    limit = offline_rate(costs, list(SHORT_CLIPS) * 80, settings.max_batch_size, 2)
    assert busy >= 0.97
    assert audio / until >= 0.95 * limit
