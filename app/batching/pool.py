"""The decoder pool (two stages, CPU): which encoded group to decode next, and in what order.

Encoded windows wait in the pool grouped by (options, padded length) until a decoder batch
takes a group: windows from several encoder calls and many requests together. A queue under
load is too shallow to sort by length; this pool is what an offline run over sorted windows
gets for free.

A group is decoded when it is full; when its oldest has waited ``max_decode_wait_ms``; when it is
alone (nothing queued to be encoded or being encoded could join it and no other short request is
in the service: a lone client gains nothing by waiting); or, failing all that, when a worker
would otherwise idle (the largest group). Groups holding a short request's window go first, and
with several API keys a key's lone waiting window beside another key's flood (>= 4 waiting)
makes its group ready at once: it does not wait for the flood's windows to fill the group. A
group holding a live final (app/windows.Urgency) is ready at once and goes first, its finals
first in it.

Only a short request's queued window is company worth waiting for. A long upload's windows
(more than a batch holds) run both stages in one call and never reach the pool; an upload of a
few windows (up to a batch, ~4 minutes) is encoded at its own pace, a window or two a call
within its memory share. Two rules held a short request's encoded window ``max_decode_wait_ms``
(6 s) beside a long upload: its queued windows of the request's padded length counted as
company that would join, and its windows held back from the reserved worker counted as work for
it, so the largest group did not go to the idle worker either (policy._ready). The issue-48 run
saw six requests in a row at ~6.9 s against ~1 s idle. Simulated (tests/test_simulation.py,
short clips of 4-25 s): beside a 20-minute upload max 7.4-7.9 s against 1.4-1.9 s idle under
both rules, as idle now; beside 3.5-minute uploads p95 4.7-5.8x idle under the first, 2.0-2.1x.

A group holding a live interim is due ``interim_max_wait_ms`` (1 s) after the interim came in,
not after ``max_decode_wait_ms``: an encoded interim is never shed (its encode is spent), and
one answered seconds late is superseded by then. At 16 simulated streams encoded interims
waited p95 2.1-4.3 s here; due at 1 s, turns of 4 s or more showing interim text went from
70 % to 80 % alone and 55 % to 72 % beside an upload (tests/test_simulation.py, the slower
host's costs), turn latency unchanged.

Pure functions: the pool itself is the owner's (app/batching/owner.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from app.batching.stages import FLOOD, GroupKey, Item, urgent_first
from app.windows import Urgency


def select(pool: Mapping[GroupKey, Sequence[Item]], encoding: Mapping[GroupKey, int], now: float,
           *, wait_s: float, limit: int, small: int, idle: bool,
           queued: Iterable[Item], shorts_in_flight: int, interim_wait_s: float | None = None,
           among: Iterable[GroupKey] | None = None) -> tuple[GroupKey | None, float | None]:
    """The group to decode now (see the module doc), else when one falls due.

    ``pool``: its groups hold only windows still waited for; ``queued``: windows waiting to be
    encoded or run (``small``: a short request's at most); ``encoding``:
    windows inside encoder calls by group; ``shorts_in_flight``: short requests' windows taken
    from the queue and not answered (these groups' own included).
    """
    joining = {k for k, n in encoding.items() if n}
    shorts = shorts_in_flight
    waiting: Counter[str | None] = Counter()  # windows waiting, by API key
    for i in queued:
        if i.job_windows <= small:  # a short request's: it will be encoded soon and join
            joining.add((i.options, i.padded))
        shorts += i.job_windows <= small
        waiting[i.owner] += 1
    for g in pool.values():
        waiting.update(i.owner for i in g)
    # A key with one window waiting beside a key flooding the service does not wait for its
    # group to fill with the flood's windows: its group goes to the next free worker.
    flood = len(waiting) > 1 and max(waiting.values()) >= FLOOD
    ready: tuple[tuple[bool, bool, float], GroupKey] | None = None
    largest: tuple[int, float, GroupKey] | None = None
    deadline: float | None = None
    keys = list(pool) if among is None else [k for k in among if k in pool]
    for key in keys:
        group = pool[key]
        if not group:
            continue
        at = group[0].pooled + wait_s
        interims = [i.enqueued for i in group if i.urgency is Urgency.LIVE_INTERIM]
        if interims and interim_wait_s is not None:
            at = min(at, min(interims) + interim_wait_s)
        # Other short requests in the service mean more are coming (a load, not a lone
        # client): then a group waits to fill.
        alone = key not in joining and shorts <= len(group)
        minority = flood and any(waiting[i.owner] <= 1 for i in group)
        final = any(i.urgency is Urgency.LIVE_FINAL for i in group)  # never waits to fill
        if len(group) >= limit or at <= now or alone or minority or final:
            order = (not final, all(i.job_windows > small for i in group), group[0].enqueued)
            if ready is None or order < ready[0]:
                ready = (order, key)
        elif deadline is None or at < deadline:
            deadline = at
        if largest is None or (len(group), -group[0].enqueued) > largest[:2]:
            largest = (len(group), -group[0].enqueued, key)
    if ready is not None:
        return ready[1], None
    if idle and largest is not None:
        return largest[2], None
    return None, deadline


def take_order(group: Sequence[Item], limit: int) -> list[Item]:
    """Up to ``limit`` windows of a group, round robin across API keys (oldest first within a
    key): a key flooding the pool gets one place per round, like every other key. Live
    finals first."""
    if len({i.owner for i in group}) > 1:
        seen: dict[str | None, int] = {}
        ranked = []
        for n, i in enumerate(group):
            seen[i.owner] = seen.get(i.owner, -1) + 1
            ranked.append((seen[i.owner], n))
        order = [group[n] for _, n in sorted(ranked)]
    else:
        order = list(group)
    return urgent_first(order)[:limit]
