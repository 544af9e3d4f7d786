"""``python -m app``'s command line (app/config/cli.py): every setting is a flag made from the
settings tree, a flag wins over its environment variable, ``--help`` lists them all and starts
nothing, and a wrong flag stops the start in one line, exit 2. (Before, every argument was
ignored: ``python -m app --help`` started a service on port 8000.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from app.config import Settings, cli
from loadtest.lib.common import free_port
from loadtest.lib.corpus import Clip
from tests.conftest import COLD, ROOT, Server
from tests.wer import wer


def run_app(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHSCRIBE_")}
    env.update(PYTHONPATH=str(ROOT), BATCHSCRIBE_HOME=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "app", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def every_flag() -> list[str]:
    """``--port``, ``--model.cache-dir``, ...: one per leaf setting of the tree but the
    secrets."""
    out = []
    for name, f in Settings.model_fields.items():
        group = f.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):
            out += [f"--{name}.{sub}".replace("_", "-") for sub in group.model_fields
                    if f"{name}.{sub}" not in cli.secrets()]
        else:
            out.append(f"--{name}".replace("_", "-"))
    return out


def test_help_lists_every_setting_and_starts_nothing(tmp_path: Path) -> None:
    got = run_app(tmp_path, "--help")
    assert got.returncode == 0, got.stderr
    flags = every_flag()
    assert len(flags) > 100
    missing = [f for f in flags if f"  {f} " not in got.stdout]
    assert not missing, missing
    assert "BATCHSCRIBE_MODEL__NAME" in got.stdout  # how a flag maps to its variable
    assert cli.secrets() == {"webhooks.secret", "live.client_secret_key"}
    assert "--webhooks.secret" not in got.stdout and "--live.client-secret-key" not in got.stdout
    assert "Bind port. (default: 8000)" in got.stdout  # each with its description and default
    assert not (tmp_path / "data").exists()  # nothing was started


def test_a_bad_value_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    got = run_app(tmp_path, "--port", "70000")
    assert got.returncode == 2
    assert got.stderr.strip() == \
        "batchscribe: cannot start: --port: Input should be less than or equal to 65535"


@pytest.mark.parametrize("args, var", [
    (["--webhooks.secret", "s3cr3t"], "BATCHSCRIBE_WEBHOOKS__SECRET"),
    (["--live.client-secret-key=s3cr3t"], "BATCHSCRIBE_LIVE__CLIENT_SECRET_KEY"),
    (["--storage.database-url", "postgresql://u:s3cr3t@db/jobs"],
     "BATCHSCRIBE_STORAGE__DATABASE_URL"),
])
def test_a_secret_is_never_a_flag(tmp_path: Path, args: list[str], var: str) -> None:
    """Another user of the host reads a process's arguments (ps), never its environment."""
    got = run_app(tmp_path, *args)
    assert got.returncode == 2
    flag = args[0].split("=")[0]
    what = "a URL with a password" if "database" in flag else "a secret"
    assert got.stderr.strip() == (f"batchscribe: cannot start: {flag}: {what} is read from "
                                  f"its variable only ({var}): a flag shows in ps")
    assert not (tmp_path / "data").exists()


def test_a_database_url_without_a_password_is_a_flag(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHSCRIBE_HOME", str(tmp_path))
    url = "postgresql://jobs@db.internal/jobs"  # a password from PGPASSWORD or .pgpass
    assert cli.read([f"--storage.database-url={url}"]).storage.database_url == url


def test_an_unknown_flag_exits_2_naming_it(tmp_path: Path) -> None:
    got = run_app(tmp_path, "--prot", "9000")
    assert got.returncode == 2
    assert got.stderr.strip().endswith("error: unrecognized arguments: --prot 9000"), got.stderr
    assert not (tmp_path / "data").exists()


def test_a_flag_wins_over_its_variable_and_the_rest_stays(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHSCRIBE_HOME", str(tmp_path))
    monkeypatch.setenv("BATCHSCRIBE_PORT", "9100")
    monkeypatch.setenv("BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE", "6")
    s = cli.read(["--port", "9001", "--model.cache-dir", str(tmp_path / "m"),
                  "--log-level=debug", "--limits.max-audio-s", "60"])
    assert (s.port, s.log_level, s.limits.max_audio_s) == (9001, "DEBUG", 60.0)
    assert s.model.cache_dir == tmp_path / "m"
    assert s.storage.data_dir == tmp_path / "data"  # still follows --home / BATCHSCRIBE_HOME
    assert s.batcher.max_batch_size == 6  # a variable no flag names is read as before
    assert cli.read([]).port == 9100
    monkeypatch.setenv("BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE", "0")
    with pytest.raises(cli.BadFlags) as bad:  # each fault named as it was given
        cli.read(["--port", "0"])
    assert str(bad.value) == ("--port: Input should be greater than or equal to 1; "
                              "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE: Input should be greater "
                              "than or equal to 1")


@pytest.mark.model
def test_the_service_serves_where_its_flags_say(make_server: type[Server], tmp_path: Path,
                                               clips: list[Clip]) -> None:
    """The real service with its port and audio limit given as flags, over variables naming
    another port and limit: it listens on the flag's port, transcribes a clip under the flag's
    limit and refuses one over it."""
    port = free_port()
    srv = make_server(tmp_path / "srv", port=port,
                      env={**COLD, "BATCHSCRIBE_PORT": str(free_port()),
                           "BATCHSCRIBE_LIMITS__MAX_AUDIO_S": "3600"},
                      args=["--port", str(port), "--limits.max-audio-s", "8"]).start()
    short = next(c for c in clips if c.id == "ljspeech-LJ001-0004")  # 5.1 s
    long = next(c for c in clips if c.id == "jfk-inaugural-1961")  # 11 s
    with srv.client() as client:
        got = {}
        for clip in (short, long):
            with clip.path.open("rb") as f:
                got[clip.id] = client.post("/transcribe", params={"wait": "true"},
                                           files={"file": (clip.path.name, f)})
    assert srv.url == f"http://127.0.0.1:{port}"
    ok, refused = got[short.id], got[long.id]
    assert ok.status_code == 200, ok.text
    assert wer([short.reference], [ok.json()["result"]["text"]]) < 0.15
    assert refused.status_code == 413, refused.text
    assert "the limit is 8 s" in refused.text
