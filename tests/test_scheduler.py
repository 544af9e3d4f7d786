"""The batcher's policy as a pure function (issue 48 item 2): ``pick(snapshot, now)`` on snapshots
built by hand, no event loop running, no engine, no clock but the ``now`` given. Fairness across
keys and jobs, urgency order, shedding, and the cost budget of what is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import numpy as np

from app.batching.fairness import ledger, window_mb
from app.batching.policy import Running, Snapshot, Take, Wait, chained, pick
from app.batching.stages import GroupKey, Item, Stage
from app.batching.urgency import Seen, stale, superseded
from app.config import BatcherSettings
from app.engine.whisper import padded_length
from app.windows import SAMPLE_RATE, DecodeOptions, Encoded, Prompt, Refresh, Urgency, Window

LOOP = asyncio.new_event_loop()  # only to make futures: it never runs
EN = DecodeOptions()
MARGIN = 8 * SAMPLE_RATE
NOW = 100.0
LIGHT = Seen().saw(NOW - 1, live=False)  # a short request came in a second ago
LIVE = Seen().saw(NOW - 1, live=True)


def padded(w: Window) -> int:
    return padded_length(len(w.audio), MARGIN)


def item(job: str, seconds: float = 3.0, *, rank: int = 0, size: int = 1,
         urgency: Urgency = Urgency.REQUEST, at: float = NOW - 1, owner: str | None = None,
         refresh: Refresh = (0, 0.0), encoded: bool = False) -> Item:
    w = Window(np.zeros(int(seconds * SAMPLE_RATE), np.float32), 0.0, seconds, Prompt("en"))
    i = Item(job, rank, w, EN, LOOP.create_future(), at, job_windows=size, padded=padded(w),
             owner=owner, urgency=urgency, refresh=refresh)
    if encoded:
        i.encoded, i.pooled = Encoded(i.padded, np.zeros(1, np.float32), "en", None), at
    return i


def upload(n: int, seconds: float = 28.0, job: str = "upload", size: int = 40) -> list[Item]:
    return [item(job, seconds, rank=k, size=size, at=NOW - 5 + k * 0.01) for k in range(n)]


def snap(queued: Iterable[Item] = (), pool: Iterable[Item] = (), redo: Sequence[Item] = (),
         running: Sequence[Running] = (), *, workers: int = 2, staged: bool = True,
         seen: Seen = LIGHT, rates: dict[Stage, float] | None = None,
         flying: Iterable[Item] = (), **settings: object) -> Snapshot:
    s = BatcherSettings(**{"job_memory_mb": 0, **settings})  # type: ignore[arg-type]
    groups: dict[DecodeOptions, list[Item]] = {}
    for i in queued:
        groups.setdefault(i.options, []).append(i)
    pooled: dict[GroupKey, list[Item]] = {}
    for i in pool:
        pooled.setdefault((i.options, i.padded), []).append(i)
    mb = window_mb(s, padded)
    held = [*flying, *(i for g in pooled.values() for i in g), *redo]
    live = sum(i.urgency is not Urgency.REQUEST for i in (*held, *(i for g in groups.values() for i in g)))
    return Snapshot(settings=s, cap=s.max_batch_size, workers=workers, running=list(running),
                    queued=groups, pool=pooled, encoding={}, redo=list(redo),
                    ledger=ledger(held, max(1, s.max_batch_size // 4), mb),
                    rates=rates or {}, seen=seen, live=live, staged=staged,
                    reserved=s.reserved_slots if staged else 0, size_class=padded,
                    padded_s=lambda i: i.padded / SAMPLE_RATE or 30.0, window_mb=mb)


def take(choice: Take | Wait) -> Take:
    assert isinstance(choice, Take), choice
    return choice


BULK = Running("run", 1, bulk=True, small=False, cost_s=1.2)


# ---- fairness ----------------------------------------------------------------------------------
def test_every_key_then_every_job_gets_a_place_in_the_batch() -> None:
    flood = [item("a1", rank=k, size=4, owner="a", at=NOW - 2 + k * 0.01) for k in range(4)]
    lone = item("b1", owner="b", at=NOW - 1)
    got = take(pick(snap([*flood, lone], staged=False, max_batch_size=4), NOW))
    assert lone in got.items and flood[3] not in got.items  # key b before a's fourth window


def test_a_short_request_beside_running_work_gets_a_batch_of_its_own() -> None:
    short = item("short", 5.0, at=NOW - 0.5)
    got = take(pick(snap([*upload(6), short], running=[BULK], staged=False), NOW))
    assert got.items == (short,) and not got.bulk


def test_a_request_waits_max_wait_ms_for_company_in_one_stage_only_beside_others() -> None:
    mine, other = item("j", at=NOW), item("k", at=NOW - 0.5)
    # another short request in flight: a load, more are coming; the group waits to fill
    assert pick(snap([mine], staged=False, max_wait_ms=50, flying=[other]), NOW) == Wait(NOW + 0.05)
    got = take(pick(snap([mine], staged=False, max_wait_ms=50, flying=[other]), NOW + 0.05))
    assert got.items == (mine,)
    # a lone client's request: no company is coming, it goes at once
    assert take(pick(snap([mine], staged=False, max_wait_ms=50), NOW)).items == (mine,)
    # two lone requests queued are company for each other: they go together, at once
    got = take(pick(snap([mine, other], staged=False, max_wait_ms=50), NOW))
    assert set(got.items) == {mine, other}
    assert take(pick(snap([mine]), NOW)).stage == "encode"  # two stages: encoding need not wait


# ---- urgency -----------------------------------------------------------------------------------
def test_a_live_final_goes_before_request_windows_queued_earlier() -> None:
    early = [item(f"j{k}", at=NOW - 3) for k in range(4)]
    final = item("live", urgency=Urgency.LIVE_FINAL, at=NOW - 0.1)
    got = take(pick(snap([*early, final], workers=1), NOW))
    assert got.items == (final,) and got.stage == "encode"  # alone: one window per encode


def test_finals_go_in_arrival_order_wherever_they_wait() -> None:
    waiting_redo = item("a", urgency=Urgency.LIVE_FINAL, at=NOW - 5, encoded=True)
    newer = item("b", urgency=Urgency.LIVE_FINAL, at=NOW - 1)
    got = take(pick(snap([newer], redo=[waiting_redo]), NOW))
    assert (got.stage, got.items) == ("redo", (waiting_redo,)) and not got.bulk
    pooled = item("c", urgency=Urgency.LIVE_FINAL, at=NOW - 3, encoded=True)
    got = take(pick(snap([newer], pool=[pooled]), NOW))
    assert (got.stage, got.items) == ("decode", (pooled,))  # ready at once: no company wait


def test_interims_wait_in_refresh_order() -> None:
    texted = item("a", urgency=Urgency.LIVE_INTERIM, refresh=(2, 10.0), at=NOW - 0.5)
    textless = item("b", urgency=Urgency.LIVE_INTERIM, refresh=(0, 40.0), at=NOW - 0.2)
    got = take(pick(snap([texted, textless], workers=1), NOW))
    assert got.items == (textless,)


# ---- shedding ----------------------------------------------------------------------------------
def test_stale_and_superseded_interims_are_shed_never_finals() -> None:
    old = item("s", urgency=Urgency.LIVE_INTERIM, at=NOW - 2)
    encoded = item("s", urgency=Urgency.LIVE_INTERIM, at=NOW - 2, encoded=True)
    final = item("s", urgency=Urgency.LIVE_FINAL, at=NOW - 2)
    assert stale([old, encoded, final], NOW, max_wait_s=1.0) == [old]  # the encoded one is kept
    assert superseded([old, encoded, final], "s") == [old, encoded]
    assert superseded([old], "other") == []


# ---- the cost budget of what is in flight -------------------------------------------------------
# Engine seconds per padded second, as the owner measures them.
RATES: dict[Stage, float] = {"run": 0.05, "encode": 0.0154, "decode": 0.01, "redo": 0.06}


def test_bulk_keeps_a_worker_free_of_it_while_short_work_is_recent() -> None:
    """Two stages: bulk takes at most workers - reserved_slots while a short request came in
    the last 30 s; with none that recent it takes every worker."""
    assert pick(snap(upload(4), running=[BULK], rates=RATES), NOW) == Wait(None)
    quiet = Seen().saw(NOW - 31, live=False)
    assert take(pick(snap(upload(4), running=[BULK], rates=RATES, seen=quiet), NOW)).bulk


def test_a_bulk_call_on_the_last_worker_is_cut_to_the_budget() -> None:
    """No worker kept free (one worker; or one stage, no reserve, the other worker in a long
    bulk call): while short work is recent the bulk call costs at most batch_cost_s (30 s
    windows at 0.05 s per padded second: 1.5 s each, two in 3 s); alone, a whole batch."""
    lone = take(pick(snap(upload(8), workers=1, rates=RATES, max_batch_size=8), NOW))
    assert lone.bulk and len(lone.items) == 2
    long = Running("run", 8, bulk=True, small=False, cost_s=12.0)
    gpu = take(pick(snap(upload(8), running=[long], staged=False, rates=RATES), NOW))
    assert len(gpu.items) == 2
    # The other worker's bulk call ends within the budget: it is the one a short request waits
    # for, and this one need not be cut.
    assert len(take(pick(snap(upload(8), running=[BULK], staged=False, rates=RATES), NOW)).items) == 8
    quiet = Seen().saw(NOW - 31, live=False)
    assert len(take(pick(snap(upload(8), workers=1, rates=RATES, seen=quiet), NOW)).items) == 8
    first = take(pick(snap(upload(8), staged=False, rates=RATES), NOW))
    assert len(first.items) == 8  # the other worker is free: no cut


def test_light_windows_do_not_ride_in_a_bulk_call() -> None:
    short = item("short", 4.0, at=NOW - 0.5)
    got = take(pick(snap([*upload(4), short], workers=1, staged=False, rates=RATES), NOW))
    assert got.items == (short,)


def test_a_fallback_waits_while_a_short_request_needs_the_last_worker() -> None:
    loop = item("looped", 10.0, size=40, encoded=True)  # a 30 s fallback: 1.8 s > budget 1.0
    short = item("short", 4.0, at=NOW - 0.2)
    got = take(pick(snap([short], redo=[loop], workers=1, rates=RATES, batch_cost_s=1.0), NOW))
    assert got.items == (short,)
    got = take(pick(snap([], redo=[loop], workers=1, rates=RATES, batch_cost_s=1.0), NOW))
    assert got.stage == "redo" and got.bulk  # nothing short waiting: it goes


def test_a_short_requests_fallback_is_its_own_work_not_bulk() -> None:
    """Beside a long upload's call on the bulk worker, a short request's looping window's
    fallback goes on the reserved worker (it waited 2.1 s for the upload's in a trace)."""
    looped = item("short", 4.0, encoded=True)
    got = take(pick(snap([], redo=[looped], running=[BULK], rates=RATES), NOW))
    assert (got.stage, got.items, got.bulk) == ("redo", (looped,), False)
    uploads = item("upload", 28.0, size=40, encoded=True)
    assert pick(snap([], redo=[uploads], running=[BULK], rates=RATES), NOW) == Wait(None)


# ---- the decoder pool --------------------------------------------------------------------------
def test_an_uploads_queued_window_is_no_company_for_a_short_request() -> None:
    """A long upload's windows run both stages in one call: one of the short request's padded
    length queued must not hold its encoded window for company (it held it 6 s)."""
    mine = item("short", 20.0, encoded=True, at=NOW - 0.3)
    long = upload(3, seconds=20.0)  # the same padded length (30 s), run in one call
    got = take(pick(snap([*long], pool=[mine], running=[BULK], rates=RATES), NOW))
    assert (got.stage, got.items) == ("decode", (mine,))


def test_an_idle_worker_decodes_pooled_interims_beside_held_back_bulk() -> None:
    """Bulk held back (its live share used up) is no work for the idle worker: the pooled
    interims' group goes to it rather than waiting to fill."""
    held = Seen(light=NOW - 1, live=NOW - 1, bulk_next=NOW + 10)
    interims = [item(f"s{k}", 6.0, urgency=Urgency.LIVE_INTERIM, encoded=True, at=NOW - 0.2)
                for k in range(2)]
    others = [item(f"t{k}", 6.0, urgency=Urgency.LIVE_INTERIM, at=NOW - 0.1) for k in range(3)]
    decode = take(pick(snap(upload(4), pool=interims, seen=held, flying=others), NOW))
    assert decode.stage == "decode" and set(decode.items) == set(interims)


def test_pooled_interims_are_due_after_the_interim_wait() -> None:
    interim = item("s", 6.0, urgency=Urgency.LIVE_INTERIM, encoded=True, at=NOW - 0.5)
    queued = item("t", 6.0, urgency=Urgency.LIVE_INTERIM, at=NOW)  # will join: not alone
    s = snap([queued], pool=[interim], running=[BULK, BULK], workers=3,
             interim_max_wait_ms=1000)
    assert isinstance(pick(s, NOW), Take)  # the queued one's encode first
    assert chained(s, NOW, {(EN, interim.padded)}) is None  # not yet due
    assert chained(s, NOW + 0.5, {(EN, interim.padded)}) is not None  # 1 s after it came in
