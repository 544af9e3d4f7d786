"""The peer yardsticks kept between runs (tests/references.py): stored once, then spot-checked
against the peer itself; a changed input or a peer that now reads otherwise recomputes all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.references as refs


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, Path]], Path]:
    monkeypatch.setattr(refs, "FOLDER", tmp_path / "references")
    model = tmp_path / "model"
    model.mkdir()
    (model / "manifest.json").write_text("{}")
    items = []
    for k in range(10):
        p = tmp_path / f"clip{k}.wav"
        p.write_bytes(bytes([k]) * 100)
        items.append((f"c{k}", p))
    return items, model


def test_stored_once_then_only_a_spread_sample_is_recomputed(setup) -> None:  # type: ignore[no-untyped-def]
    items, model = setup
    asked: list[list[str]] = []

    def peer(paths: list[Path]) -> list[str]:
        asked.append([p.stem for p in paths])
        return [f"says-{p.stem}" for p in paths]

    first = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    again = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    assert first == again == [f"says-clip{k}" for k in range(10)]
    assert asked == [[f"clip{k}" for k in range(10)], ["clip0", "clip4", "clip9"]]


def test_a_new_version_a_changed_clip_or_a_changed_answer_recomputes_everything(setup) -> None:  # type: ignore[no-untyped-def]
    items, model = setup
    answer = {"v": "a"}
    calls: list[int] = []

    def peer(paths: list[Path]) -> list[str]:
        calls.append(len(paths))
        return [f"{answer['v']}-{p.stem}" for p in paths]

    refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3)  # new version
    items[5][1].write_bytes(b"changed")
    refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3)  # changed clip
    answer["v"] = "b"  # the peer now reads the sample otherwise: all again, and stored
    got = refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3)
    assert got == [f"b-clip{k}" for k in range(10)]
    assert calls == [10, 10, 10, 3, 10]
    assert refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3) == got
    assert calls[-1] == 3


def test_each_cpu_keeps_its_own_entry(setup, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    items, model = setup
    calls: list[tuple[str, int]] = []
    cpu = {"now": "cpu-a"}
    monkeypatch.setattr(refs, "cpu_key", lambda: cpu["now"])

    def peer(paths: list[Path]) -> list[str]:
        calls.append((cpu["now"], len(paths)))
        return [f"{cpu['now']}-{p.stem}" for p in paths]

    a = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    cpu["now"] = "cpu-b"
    b = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    cpu["now"] = "cpu-a"  # the first host finds its own entry, kept beside the second's
    assert refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3) == a != b
    assert calls == [("cpu-a", 10), ("cpu-b", 10), ("cpu-a", 3)]
    refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3)  # a new version
    cpu["now"] = "cpu-b"  # drops the other host's entry for the old version
    refs.peer_reference("p", items, peer, {"peer": "2"}, model, spot=3)
    assert calls[-2:] == [("cpu-a", 10), ("cpu-b", 10)]
    stored = json.loads((refs.FOLDER / "p.json").read_text())["entries"]
    assert [(e["key"]["cpu"], e["key"]["versions"]) for e in stored] == [
        ("cpu-a", {"peer": "2"}), ("cpu-b", {"peer": "2"})]


def test_an_entry_stored_under_the_model_name_alone_is_found_and_kept(
        setup: tuple[list[tuple[str, Path]], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries stored before :func:`refs.cpu_key` carry the CPU's model name alone: a host of
    that name checks its spot sample against them; one that reads otherwise stores its own."""
    items, model = setup
    host = {"key": "EPYC (zen2)", "reads": "zen2"}
    monkeypatch.setattr(refs, "cpu_model", lambda: "EPYC")
    monkeypatch.setattr(refs, "cpu_key", lambda: host["key"])
    calls: list[tuple[str, int]] = []

    def peer(paths: list[Path]) -> list[str]:
        calls.append((host["key"], len(paths)))
        return [f"{host['reads']}-{p.stem}" for p in paths]

    monkeypatch.setattr(refs, "cpu_key", lambda: "EPYC")  # an old run: the name alone
    refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    monkeypatch.setattr(refs, "cpu_key", lambda: host["key"])
    got = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)  # same reads
    assert got == [f"zen2-clip{k}" for k in range(10)] and calls[-1] == ("EPYC (zen2)", 3)
    host.update(key="EPYC (zen3)", reads="zen3")  # another generation reads otherwise
    got = refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3)
    assert got == [f"zen3-clip{k}" for k in range(10)] and calls[-2:] == [
        ("EPYC (zen3)", 3), ("EPYC (zen3)", 10)]
    stored = json.loads((refs.FOLDER / "p.json").read_text())["entries"]
    assert [e["key"]["cpu"] for e in stored] == ["EPYC", "EPYC (zen3)"]
    assert refs.peer_reference("p", items, peer, {"peer": "1"}, model, spot=3) == got
    assert calls[-1] == ("EPYC (zen3)", 3)  # its own entry now
