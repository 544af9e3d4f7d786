"""Settings that refuse a typo (issue 48 item 7): every group forbids fields it does not know, a
``BATCHSCRIBE_*`` variable that names no setting is refused, the error is one line naming the
variable (with the setting it may have meant), and every setting lives in the one tree
(``BATCHSCRIBE_HOME``, ``BATCHSCRIBE_LOG_LEVEL``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from app.config import TOOL_VARIABLES, Settings, problem, unknown_variables
from tests.conftest import ROOT


def refused(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    return problem(info.value)


def test_an_unknown_top_level_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-settings reads only the variables of known fields: without the scan a typo of
    a top-level setting would be ignored."""
    assert refused(monkeypatch, BATCHSCRIBE_PROT="9000") == \
        "unknown setting BATCHSCRIBE_PROT (did you mean BATCHSCRIBE_PORT?)"


@pytest.mark.parametrize("key, meant", [
    ("BATCHSCRIBE_MODEL__NAMEE", "BATCHSCRIBE_MODEL__NAME"),
    ("BATCHSCRIBE_BATCHER__MAX_BATCH_SIZ", "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE"),
    ("BATCHSCRIBE_LIVE__MAX_SESIONS", "BATCHSCRIBE_LIVE__MAX_SESSIONS"),
    ("BATCHSCRIBE_STORAGE__DATA_DRI", "BATCHSCRIBE_STORAGE__DATA_DIR"),
])
def test_an_unknown_nested_variable_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch, key: str, meant: str) -> None:
    assert refused(monkeypatch, **{key: "1"}) == f"unknown setting {key} (did you mean {meant}?)"


def test_a_name_far_from_any_setting_gets_no_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    assert refused(monkeypatch, BATCHSCRIBE_QQQ="1") == "unknown setting BATCHSCRIBE_QQQ"


def test_a_bad_value_is_one_line_naming_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    line = refused(monkeypatch, BATCHSCRIBE_PORT="70000", BATCHSCRIBE_MODEL__DEVICE="tpu")
    assert "\n" not in line
    assert line.startswith("BATCHSCRIBE_PORT: Input should be less than or equal to 65535; ")
    assert "BATCHSCRIBE_MODEL__DEVICE: Input should be 'auto', 'cpu' or 'cuda'" in line


def test_the_tools_variables_are_not_settings_and_are_let_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's, the benchmarks' and the test suite's variables may sit in the same
    environment as the service's (scripts/test exports BATCHSCRIBE_EXTRA_APT)."""
    for key in (*TOOL_VARIABLES, "BATCHSCRIBE_TEST_WORKERS", "BATCHSCRIBE_TEST_ANYTHING"):
        monkeypatch.setenv(key, "1")
    Settings()
    assert unknown_variables({"BATCHSCRIBE_URL": "x", "OTHER_PORT": "1"}) == []
    top = {k.upper() for k in Settings.model_fields}
    assert not {k.removeprefix("BATCHSCRIBE_") for k in TOOL_VARIABLES} & top


def test_variables_are_read_in_any_case_and_so_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("batchscribe_port", "9001")
    assert Settings().port == 9001
    assert refused(monkeypatch, batchscribe_prot="1").startswith("unknown setting batchscribe_prot")


def test_home_holds_models_and_data_unless_they_are_set(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHSCRIBE_HOME", str(tmp_path))
    s = Settings()
    assert (s.home, s.model.cache_dir, s.storage.data_dir) == \
        (tmp_path, tmp_path / "models", tmp_path / "data")
    monkeypatch.setenv("BATCHSCRIBE_MODEL__CACHE_DIR", "/srv/models")
    s = Settings()
    assert (s.model.cache_dir, s.storage.data_dir) == (Path("/srv/models"), tmp_path / "data")
    from models.provision import default_cache_dir

    assert default_cache_dir() == Path("/srv/models")  # provisioning reads the same tree


def test_the_log_level_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().log_level == "INFO"
    monkeypatch.setenv("BATCHSCRIBE_LOG_LEVEL", "debug")
    assert Settings().log_level == "DEBUG"
    assert refused(monkeypatch, BATCHSCRIBE_LOG_LEVEL="loud").startswith(
        "BATCHSCRIBE_LOG_LEVEL: Input should be 'DEBUG'")


def test_init_arguments_are_checked_as_strictly() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Settings(model={"nmae": "x"})  # type: ignore[arg-type]


def every_variable(model: type[BaseModel] = Settings, prefix: str = "BATCHSCRIBE_") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= every_variable(ann, f"{prefix}{name.upper()}__")
        else:
            out.add(f"{prefix}{name.upper()}")
    return out


def test_every_variable_the_configuration_page_names_is_a_setting() -> None:
    """docs/configuration.md names variables, abbreviating siblings (``/ `__CHUNK_S```): each
    is a setting or one of the tools' variables."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    known = every_variable() | TOOL_VARIABLES
    named: set[str] = set()
    for row in text.splitlines():
        full = re.findall(r"`(BATCHSCRIBE_[A-Z0-9_]+)`", row)
        named |= set(full)
        group = next((f.rsplit("__", 1)[0] for f in full if "__" in f), None)
        named |= {f"{group}{tail}" for tail in re.findall(r"`(__[A-Z0-9_]+)`", row) if group}
        named |= {f"BATCHSCRIBE{tail}" for tail in re.findall(r"`(_[A-Z0-9_]+)`", row)
                  if not tail.startswith("__")}
    named -= {n for n in named if n.startswith("BATCHSCRIBE_TEST_")}
    assert len(named) >= 60
    assert named <= known, sorted(named - known)


def test_the_service_refuses_to_start_on_a_typo_in_one_line(tmp_path: Path) -> None:
    """End to end: ``python -m app`` with a misspelt variable exits 2 before anything loads,
    with one line on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHSCRIBE_")}
    env.update(PYTHONPATH=str(ROOT), BATCHSCRIBE_HOME=str(tmp_path),
               BATCHSCRIBE_BATCHER__MAX_WAIT_SM="10")
    got = subprocess.run([sys.executable, "-m", "app"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip() == ("batchscribe: cannot start: unknown setting "
                                  "BATCHSCRIBE_BATCHER__MAX_WAIT_SM (did you mean "
                                  "BATCHSCRIBE_BATCHER__MAX_WAIT_MS?)")
