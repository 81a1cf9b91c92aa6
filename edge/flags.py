"""Command-line flags with ``SKIFF_*`` environment twins, for every process.

Every skiff process (LLM worker, speech worker, gateway) is configured the
same way: a flag, else its environment variable, else the default. Compose
files and Kubernetes manifests set variables; people type flags. One table of
``Flag`` per process feeds argparse here, so the rules are written once:

- a flag's variables are tried in order (the speech worker reads
  ``SKIFF_SPEECH_THREADS`` and shares ``SKIFF_METRICS_PORT`` with the rest);
  by default there is one, ``PREFIX + NAME`` (``--ctx-per-lane`` ->
  ``SKIFF_CTX_PER_LANE``);
- a variable that does not parse stops the process at start-up with its name
  and value (argparse's own error, exit 2), never a traceback;
- a repeatable flag (``--worker``) takes its variable as a list, and flags
  given on the command line replace the variable's list rather than add to
  it;
- ``--help`` shows each flag's variables and default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    name: str  # without the dashes: "ctx-per-lane"
    kind: Callable[[str], Any]  # int, float, str, or a converter raising ValueError
    help: str
    default: Any = None
    env: tuple[str, ...] = ()  # variables, first set wins; () = PREFIX + NAME
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # may be given several times; its variable is a list
    sep: str = ","  # between a repeat flag's items in its variable
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    def variables(self, prefix: str) -> tuple[str, ...]:
        return self.env or (prefix + self.name.upper().replace("-", "_"),)


def env_name(prefix: str, name: str) -> str:
    """The variable of a flag: ``SKIFF_`` + ``ctx-per-lane`` -> ``SKIFF_CTX_PER_LANE``."""
    return prefix + name.upper().replace("-", "_")


class Flags:
    """One process's flags: added to a parser, read back with their variables."""

    def __init__(self, flags: Sequence[Flag], prefix: str = "SKIFF_") -> None:
        self.flags = tuple(flags)
        self.prefix = prefix

    def variables(self) -> set[str]:
        """Every variable these flags read (compose and manifest checks use it)."""
        return {v for f in self.flags for v in f.variables(self.prefix)}

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        for f in self.flags:
            names = f.variables(self.prefix)
            shown = " or ".join(names)
            extra: dict[str, Any] = {}
            if f.choices is not None:
                extra["choices"] = f.choices
            if f.metavar is not None:
                extra["metavar"] = f.metavar
            if f.repeat:
                given = _split(f, names)
                default = f.default if given is None else given
                parser.add_argument(
                    f"--{f.name}",
                    action="append",
                    default=None,
                    help=f"{f.help}; repeatable [env {shown}, '{f.sep}'-separated; "
                    f"default {default!r}]",
                    **extra,
                )
                continue
            given = _from_env(parser, f, names)
            parser.add_argument(
                f"--{f.name}",
                type=f.kind,
                default=f.default if given is None else given,
                help=f"{f.help} [env {shown}; default %(default)s]",
                **extra,
            )

    def finish(self, ns: argparse.Namespace) -> argparse.Namespace:
        """Repeat flags not given on the command line take their variable's list."""
        for f in self.flags:
            if f.repeat and getattr(ns, f.dest) is None:
                given = _split(f, f.variables(self.prefix))
                setattr(ns, f.dest, list(f.default or ()) if given is None else given)
        return ns

    def parse(
        self, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
    ) -> argparse.Namespace:
        self.add_to(parser)
        return self.finish(parser.parse_args(argv))


def _split(f: Flag, names: Sequence[str]) -> list[str] | None:
    """A repeat flag's list from the first set variable; None when none is set."""
    for name in names:
        raw = os.environ.get(name)
        if raw is not None:
            return [item.strip() for item in raw.split(f.sep) if item.strip()]
    return None


def _from_env(parser: argparse.ArgumentParser, f: Flag, names: Sequence[str]) -> Any:
    """The first set variable's value, converted; None when none is set."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = f.kind(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{name}={raw!r}: {exc}")
        if f.choices is not None and value not in f.choices:
            parser.error(f"{name}={raw!r}: choose from {', '.join(f.choices)}")
        return value
    return None
