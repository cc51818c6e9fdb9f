"""Errors the CLI maps to exit codes: bad input (2) versus failure at run time (1)."""

from __future__ import annotations


class HorizonError(Exception):
    """A failure at run time: exit status 1, one line."""

    exit_code = 1


class InputError(HorizonError):
    """Bad usage, config or input: exit status 2, one line naming the file, key or tensor at fault."""

    exit_code = 2


class DryRunRefused(InputError):
    """`--dry-run` of a start that would stop: the start's own line (exit 2), and the plan the dry
    run printed (and wrote with --json) in `report`."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


class ConfigError(InputError):
    """One or more config problems; each names the dotted key."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(problems))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the command unwinds as on ctrl-c; exit status 143."""

    exit_code = 143
