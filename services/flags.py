"""Every command-line flag can also come from a `DSASERVE_*` environment variable.

`--redis-url` reads `DSASERVE_REDIS_URL`, `--api-key` reads `DSASERVE_API_KEY`, and so on: the
long option name, upper-cased, dashes to underscores. The command line wins over the environment.
Repeatable flags (`action=Repeatable`, or argparse's "append") take a comma-separated list;
on/off flags take 1/0, true/false, yes/no or on/off.

Call `env_defaults(parser)` after the last `add_argument`: it turns each variable that is set into
that flag's default, so `--help`, type conversion and `required=True` all keep working.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "DSASERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Repeatable(argparse._AppendAction):
    """`append`, except that the first use on the command line replaces the default list.

    argparse's own "append" adds command-line values to a non-empty default, so a key given with
    `--api-key` would be used alongside, not instead of, the keys from DSASERVE_API_KEY.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def env_name(option_string: str) -> str:
    """`--redis-url` -> `DSASERVE_REDIS_URL`."""
    return PREFIX + option_string.lstrip("-").upper().replace("-", "_")


def env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Make each `DSASERVE_*` variable that is set the default of its flag (idempotent)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        long_options = [s for s in action.option_strings if s.startswith("--")]
        if not long_options or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        name = env_name(long_options[0])
        if (
            action.help is not None
            and action.help is not argparse.SUPPRESS
            and name not in action.help
        ):
            action.help = f"{action.help} [env {name}]"
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            action.default = _convert(action, raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"environment variable {name}={raw!r}: {e}")
        action.required = False


def _convert(action: argparse.Action, raw: str) -> Any:
    if action.nargs == 0:
        return _switch(action, raw)
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        return [_scalar(action, item.strip()) for item in raw.split(",") if item.strip()]
    return _scalar(action, raw)


def _switch(action: argparse.Action, raw: str) -> bool:
    word = raw.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        return word in _TRUE
    if isinstance(action, argparse._StoreFalseAction):
        return word in _FALSE
    raise TypeError(f"{type(action).__name__} flags cannot be set from the environment")


def _scalar(action: argparse.Action, raw: str) -> Any:
    value = action.type(raw) if callable(action.type) else raw
    choices: Sequence[Any] | None = action.choices  # type: ignore[assignment]
    if choices is not None and value not in choices:
        raise ValueError(f"must be one of {', '.join(map(str, choices))}")
    return value
