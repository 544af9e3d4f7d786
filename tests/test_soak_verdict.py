"""loadtest.soak's memory verdict tells a one-off step from a leak, and passes neither."""

from __future__ import annotations

from loadtest.soak import summarise

MIB = 2**20


def series(rss_mib: list[float], every_s: float = 5.0) -> list[tuple[float, int]]:
    return [(k * every_s, int(r * MIB)) for k, r in enumerate(rss_mib)]


def test_flat() -> None:
    s = summarise(series([2000 + (k % 3) for k in range(240)]), 240, 1200)
    assert s["verdict"] == "flat"


def test_a_step_then_flat_is_a_step() -> None:
    """The multilingual soak's shape: 3,352 MiB, one jump to 4,453 MiB at ~330 s, flat after."""
    rss = [3352.0] * 66 + [4118.0] + [4453.0] * 173  # the rise spans two samples, as there
    s = summarise(series(rss), 240, 1200)
    assert s["verdict"] == "step"
    assert s["largest_rise_in_a_minute_mib"] > 1000 and s["largest_rise_ends_at_s"] == 335.0
    assert abs(s["growth_after_it_mib"]) < 64


def test_a_steady_rise_is_growing() -> None:
    s = summarise(series([2000 + 1.5 * k for k in range(240)]), 240, 1200)
    assert s["verdict"] == "growing"


def test_a_step_that_keeps_rising_is_growing() -> None:
    rss = [2000.0] * 100 + [2500 + 2.0 * k for k in range(140)]
    assert summarise(series(rss), 240, 1200)["verdict"] == "growing"
