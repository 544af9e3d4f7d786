"""The batcher's state has one writer (issue 48 item 2): checked on the source and at run time.

* **Source.** In app/batching only the owner (app/batching/owner.py) writes state: no other
  module assigns to an attribute or item of an object it did not create in the same function,
  nor calls a mutating method (append, pop, update, ...) on one. The exceptions are named below
  with their reason: an object's own constructor, the owner task's bookkeeping of its engine
  calls in the batcher's shell, and the speaker models' batcher (its own, separate state).
* **Run time.** Every call into the owner (messages applied, calls chosen, the end) happens on
  the owner task itself, whatever callers, engine calls and the engine pool do meanwhile.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import app.batching
from app.batching.owner import Owner
from app.config import BatcherSettings, Settings
from app.engine.placement import make_pool
from app.jobs.pipeline import make_batcher
from app.metrics import Metrics
from app.windows import DecodeOptions, Urgency
from tests.fakes import BOUND, FakeStagedEngine, gather, tagged_window

PACKAGE = Path(app.batching.__file__).parent
OWNER = "owner.py"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popleft", "appendleft", "clear",
            "update", "setdefault", "add", "discard", "sort", "reverse", "subtract",
            "extendleft", "rotate", "__setitem__", "__delitem__"}
ALLOWED = {
    # (module, function, attribute): why it is not queue state written elsewhere
    ("batcher.py", "start", "_task"): "the owner task's handle, set once",
    ("batcher.py", "stop", "_stopping"): "the caller-side refusal of new windows",
    ("batcher.py", "_run", "_calls"): "the owner task's engine-call tasks, on the owner task",
    ("batcher.py", "_own", "_calls"): "the same, as their Done messages arrive",
}
OTHER_OWNERS = {("primitive.py", "ModelBatcher")}  # the speaker models' batcher: its own state


def functions(tree: ast.AST) -> Iterator[tuple[str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield node.name, f
        elif isinstance(node, ast.Module):
            for f in node.body:
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield None, f


def root(node: ast.expr) -> tuple[str | None, str | None]:
    """The name an attribute/subscript chain starts from, and the first attribute after it."""
    attr = None
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            attr = node.attr
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attr


NEW = (ast.List, ast.Dict, ast.Set, ast.Tuple, ast.ListComp, ast.DictComp, ast.SetComp,
       ast.GeneratorExp, ast.Call)


def created(f: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names the function binds to an object it makes (a literal, a comprehension, a call's
    result); not its parameters, nor loop variables over objects it was given."""
    names: set[str] = set()
    for node in ast.walk(f):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, NEW):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def writes(module: str) -> list[str]:
    """Every write in ``module`` to an object its function did not make (see the module doc)."""
    tree = ast.parse((PACKAGE / module).read_text())
    found = []
    for cls, f in functions(tree):
        if (module, cls) in OTHER_OWNERS:
            continue
        own = created(f)
        targets: list[ast.expr] = []
        for node in ast.walk(f):
            if isinstance(node, ast.Assign | ast.Delete):
                targets += node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets.append(node.target)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS:
                targets.append(node.func.value)
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Name):
                    if e.id in own or not isinstance(e.ctx, ast.Load):
                        continue  # binding a name, or mutating an object it made
                elif not isinstance(e, ast.Attribute | ast.Subscript):
                    continue
                name, attr = root(e) if not isinstance(e, ast.Name) else (e.id, None)
                if name in own and name != "self":
                    continue  # an object the function made itself
                if name == "self" and f.name in ("__init__", "_init"):
                    continue  # building its own object
                if (module, f.name, attr) in ALLOWED:
                    continue
                found.append(f"{module}:{e.lineno} {cls or ''}.{f.name} writes {ast.unparse(e)}")
    return found


def test_only_the_owner_writes_batcher_state() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != OWNER)
    assert "policy.py" in modules and "batcher.py" in modules
    found = [w for m in modules for w in writes(m)]
    assert found == []


def test_the_check_sees_a_write() -> None:
    """The source check is not blind: the owner's own module is full of writes."""
    assert len(writes(OWNER)) > 20


async def test_the_owner_runs_only_on_the_owner_task(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[asyncio.Task[Any] | None] = []
    for name in ("apply", "next", "abort"):
        real = getattr(Owner, name)

        def spy(self: Owner, *args: Any, _real: Any = real) -> Any:
            seen.append(asyncio.current_task())
            return _real(self, *args)

        monkeypatch.setattr(Owner, name, spy)
    fake = FakeStagedEngine(workers=2)
    fake.loops = {3}  # a fallback too
    settings = Settings(batcher=BatcherSettings(max_batch_size=8, max_wait_ms=5, job_memory_mb=0))
    pool = make_pool([fake], settings)
    batcher = make_batcher(settings, pool, Metrics())
    batcher.start()
    try:
        en = DecodeOptions()
        futs = batcher.submit("a", [tagged_window(k, 3 + k) for k in range(6)], en)
        live = batcher.submit("b", [tagged_window(10)], en, urgency=Urgency.LIVE_FINAL)
        gone = batcher.submit("c", [tagged_window(11)], en)
        gone[0].cancel()
        batcher.demote("b")
        batcher.retire_slots(1)
        batcher.restore_slots(1)
        assert len(await gather([*futs, *live])) == 7
        await asyncio.wait_for(asyncio.shield(asyncio.sleep(0)), BOUND)
    finally:
        await batcher.stop(5)
    assert seen and all(t is batcher._task for t in seen)
    assert any(c[0] == "redo" for c in fake.calls)
