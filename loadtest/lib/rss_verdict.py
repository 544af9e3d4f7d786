"""The soak's memory verdict: RSS samples after a warm-up judged flat, a one-off step, or growing
(:func:`summarise`; loadtest/soak.py reads the samples)."""

from __future__ import annotations

from typing import Any


def slope(points: list[tuple[float, int]]) -> float:
    """Least-squares bytes per second."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (r - mr) for t, r in points) / den if den else 0.0


STEP_S = 60.0
SPAN_S = 120.0  # the floor and ceiling windows: two of the heap's once-a-minute releases


def envelope(points: list[tuple[float, int]], span_s: float = SPAN_S) -> list[tuple[float, int, int]]:
    """(start, lowest, highest) RSS of each ``span_s`` window; a last window under half a span
    (one sample at the run's end) is left out."""
    out: list[tuple[float, int, int]] = []
    t0 = points[0][0]
    while t0 <= points[-1][0]:
        seg = [(t, r) for t, r in points if t0 <= t < t0 + span_s]
        if seg and (not out or seg[-1][0] - seg[0][0] >= span_s / 2):
            out.append((t0, min(r for _, r in seg), max(r for _, r in seg)))
        t0 += span_s
    return out


def summarise(samples: list[tuple[float, int]], warmup_s: float, duration_s: float) -> dict[str, Any]:
    """RSS after the warm-up: ``flat``, else ``step`` or ``growing``. Both fail; they differ in
    what to look for. A step is most of the rise within one minute, with the samples after it
    flat by the same rule: a floor raised once (an allocation kept after the largest batch, a
    cache filled), bounded, not a leak. Growing is a rise that goes on: a leak, or an unbounded
    cache.

    Flat is judged on the **floor**, each two-minute window's lowest RSS, whose fitted growth
    must stay under max(64 MiB, 5 % of the mean), and on the **ceiling**: the last quarter may
    not set a new high by more than that. The engine hands its free heap back once a minute
    under load (app/engine/heap.py), so RSS is a sawtooth: 1.1-2.9 GB in the multilingual soak
    at c8bd228. A line fitted to the raw samples read the sawtooth's phase there, +128.8 MiB
    ("growing") on a run whose floor moved -3 MiB, whose top was reached at 600 s and not
    passed, and which ended 217 MiB below its start. A leak raises the floor (what survives a
    release); memory that is only held free raises the ceiling, which must level off."""
    mib = 2**20
    after = [(t, r) for t, r in samples if t >= warmup_s]
    if len(after) < 2:
        return {"verdict": "too short", "samples_after_warmup": len(after)}
    span = after[-1][0] - after[0][0]
    rate = slope(after)
    growth = rate * span
    mean = sum(r for _, r in after) / len(after)
    allowed = max(64 * mib, 0.05 * mean)
    env = envelope(after)
    floor = [(t, lo) for t, lo, _ in env]
    floor_growth = slope(floor) * (floor[-1][0] - floor[0][0]) if len(floor) >= 2 else growth
    late = after[-1][0] - span / 4
    new_high = max(r for t, r in after if t >= late) - max(
        (r for t, r in after if t < late), default=after[0][1])
    # The largest rise within STEP_S (the multilingual soak's rose 1,100 MiB over two samples).
    jumps = []
    for i, (t0, r0) in enumerate(after):
        for j in range(i + 1, len(after)):
            if after[j][0] - t0 > STEP_S:
                break
            jumps.append((after[j][1] - r0, -j))  # the earliest end among equal rises
    jump, at = max(jumps)
    at = -at
    tail = after[at:]
    tail_growth = slope(tail) * (tail[-1][0] - tail[0][0]) if len(tail) >= 2 else 0.0
    verdict = "flat"
    if floor_growth >= allowed or new_high >= allowed:
        one_off = jump >= 0.8 * (after[-1][1] - after[0][1]) and abs(tail_growth) < allowed
        verdict = "step" if one_off and len(tail) >= 0.25 * len(after) else "growing"
    return {
        "rss_at_warmup_mib": round(after[0][1] / mib, 1), "rss_end_mib": round(after[-1][1] / mib, 1),
        "rss_peak_mib": round(max(r for _, r in samples) / mib, 1),
        "rss_min_after_warmup_mib": round(min(r for _, r in after) / mib, 1),
        "rss_max_after_warmup_mib": round(max(r for _, r in after) / mib, 1),
        "floor_mib": [round(lo / mib) for _, lo, _ in env],
        "ceiling_mib": [round(hi / mib) for _, _, hi in env],
        "floor_growth_mib": round(floor_growth / mib, 1),
        "last_quarter_new_high_mib": round(new_high / mib, 1),
        "allowed_growth_mib": round(allowed / mib, 1),
        "slope_mib_per_min": round(rate * 60 / mib, 3), "fitted_growth_mib": round(growth / mib, 1),
        "largest_rise_in_a_minute_mib": round(jump / mib, 1),
        "largest_rise_ends_at_s": round(after[at][0], 1),
        "growth_after_it_mib": round(tail_growth / mib, 1),
        "verdict": verdict,
        "duration_s": duration_s, "warmup_s": warmup_s, "samples_after_warmup": len(after),
    }
