"""``python -m app``'s command line: every setting as a flag, made by pydantic-settings from the
same tree the environment fills (``--port 9000`` is ``BATCHSCRIBE_PORT=9000``,
``--model.name whisper-small`` is ``BATCHSCRIBE_MODEL__NAME=whisper-small``); a flag wins over
its variable.

Before this the command took no arguments and ignored every one: ``python -m app --help``, or
``scripts/serve --port 9000``, started the service on port 8000 (or failed there, the port taken),
which is not what a user typing either expects. Now ``--help`` lists every setting with its
description and bounds and exits, an unknown flag exits 2 with argparse's usage line, and a bad
value exits 2 with one line naming the flag, as a bad variable names the variable. Secrets are
variables only (:func:`secrets`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError
from pydantic_settings import CliSettingsSource

from app.config import PREFIX, Settings, problem

PROG = "python -m app"
DESCRIPTION = ("Run the batchscribe service. Each setting below is also an environment variable: "
               f"--port is {PREFIX}PORT, --model.name is {PREFIX}MODEL__NAME (a group's fields "
               "after a double underscore); a flag wins over its variable. With none, the "
               "embedded defaults: SQLite under --home, the provisioned whisper-base model, CUDA "
               "if present else CPU, 127.0.0.1:8000. docs/configuration.md explains each.")


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                   usage=f"{PROG} [-h] [--SETTING VALUE ...]")


def read(argv: Sequence[str]) -> Settings:
    """The settings from the environment and ``argv`` (flags win). ``--help`` and argparse's
    own errors exit (0 and 2); a value out of bounds raises :class:`BadFlags`."""
    if secret := sorted(given(argv) & secrets()):
        raise BadFlags(f"--{secret[0].replace('_', '-')}: a secret is read from its variable "
                       f"only ({variable(secret[0])}): a flag shows in ps")
    if any(urlsplit(url).password for url in values(argv, "--storage.database-url")):
        raise BadFlags("--storage.database-url: a URL with a password is read from its variable "
                       f"only ({variable('storage.database_url')}): a flag shows in ps")
    source: CliSettingsSource[argparse.ArgumentParser] = CliSettingsSource(
        Settings, root_parser=parser(), cli_kebab_case=True,
        cli_avoid_json=True, cli_hide_none_type=True)
    parsed = source(args=list(argv))
    try:
        return Settings(_cli_settings_source=parsed)
    except ValidationError as exc:
        raise BadFlags(problem(exc, given(argv))) from exc


class BadFlags(ValueError):
    """The settings, flags and variables together, do not validate (one line, ``str``)."""


def secrets() -> frozenset[str]:
    """The secret settings (``SecretStr``: ``webhooks.secret``, ``live.client_secret_key``),
    hidden from ``--help`` and refused as flags: another user of the host sees a process's
    arguments, never its environment."""
    out = set()
    for name, f in Settings.model_fields.items():
        group = f.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):
            out |= {f"{name}.{sub}" for sub, g in group.model_fields.items()
                    if "SecretStr" in str(g.annotation)}
    return frozenset(out)


def variable(setting: str) -> str:
    """``storage.database_url`` -> ``BATCHSCRIBE_STORAGE__DATABASE_URL``."""
    return PREFIX + setting.replace(".", "__").upper()


def values(argv: Sequence[str], flag: str) -> list[str]:
    """The values given to ``flag`` (``--flag v`` or ``--flag=v``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            out.append(arg[len(flag) + 1:])
        elif arg == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
    return out


def given(argv: Sequence[str]) -> frozenset[str]:
    """The settings named on the command line, as pydantic's locations joined by dots with
    underscores (``--model.cache-dir=/x`` -> ``model.cache_dir``)."""
    out = set()
    for arg in argv:
        if arg.startswith("--"):
            out.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return frozenset(out)
