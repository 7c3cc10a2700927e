"""Settings dataclasses -> command-line flags and `DSASERVE_*` environment variables.

Each process kind has one settings dataclass (`EngineConfig`, `WorkerSettings`,
`RouterSettings`, ...) whose fields carry their help text (`engine.config.setting`). This
module derives everything else from it: the argparse flags (`--max-model-len`), their
`DSASERVE_*` variables (`DSASERVE_MAX_MODEL_LEN`), `--help`, and the flag table the deploy tests
hold docker-compose and Kubernetes command lines to. A field whose type is itself a settings
dataclass contributes its fields as a flag group (a worker's settings hold an `EngineConfig`).

The command line wins over the environment. Repeatable flags (tuple fields) take a
comma-separated list from the environment, and the first use on the command line replaces that
list; on/off flags take 1/0, true/false, yes/no or on/off, and those whose field defaults to
None (decided later) also have a `--no-` form. Old flag names listed as `aliases`
still work, on the command line and as variables, but --help shows only the current name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

PREFIX = "DSASERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
if TYPE_CHECKING:
    from _typeshed import DataclassInstance

S = TypeVar("S", bound="DataclassInstance")


@dataclass(frozen=True)
class Flag:
    """One command-line flag as derived from a settings field."""

    dest: str  # the field name
    option: str  # "--max-model-len"
    aliases: tuple[str, ...]  # hidden old spellings
    short: str | None  # "-tp"
    kind: type  # str | int | float | bool (a switch) | tuple (repeatable strings)
    default: Any  # dataclasses.MISSING when the flag is required
    choices: tuple[Any, ...] | None
    help: str
    positional: bool

    @property
    def env(self) -> str:
        return env_name(self.option)

    @property
    def takes_value(self) -> bool:
        return self.kind is not bool


def env_name(option: str) -> str:
    """`--redis-url` -> `DSASERVE_REDIS_URL`."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def flags(cls: type) -> list[Flag]:
    """The flags of a settings dataclass, nested settings included, in field order."""
    return [f for _, f in _walk(cls)]


def _walk(cls: type, prefix: str = "") -> Iterator[tuple[type, Flag]]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _walk(hint, f"{prefix}{field.name}.")
            continue
        if meta.get("cli") is False:
            continue
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        yield (
            cls,
            Flag(
                dest=prefix + field.name,
                option=meta.get("flag") or "--" + field.name.replace("_", "-"),
                aliases=tuple(meta.get("aliases", ())),
                short=meta.get("short"),
                kind=_kind(cls, field.name, hint),
                default=default,
                choices=tuple(meta["choices"]) if "choices" in meta else None,
                help=meta.get("help", ""),
                positional=bool(meta.get("positional")),
            ),
        )


def _kind(cls: type, name: str, hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{name}: unions other than `X | None` are not flags")
        hint = args[0]
    if typing.get_origin(hint) is tuple:
        return tuple
    if hint in (str, int, float, bool):
        return hint
    raise TypeError(f"{cls.__name__}.{name}: type {hint!r} cannot be a flag")


class _Repeatable(argparse._AppendAction):
    """`append`, except that the first use on the command line replaces the default list
    (argparse's own would add command-line keys to those from the environment)."""

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


def add_settings(
    parser: argparse.ArgumentParser, cls: type, environ: Mapping[str, str] | None = None
) -> None:
    """Add the flags of `cls` (grouped by dataclass), their defaults taken from the environment."""
    environ = os.environ if environ is None else environ
    groups: dict[type, Any] = {}
    for owner, flag in _walk(cls):
        if owner not in groups:
            title = (owner.__doc__ or owner.__name__).strip().splitlines()[0]
            groups[owner] = parser.add_argument_group(title) if owner is not cls else parser
        default = _env_default(parser, flag, environ)
        _add(groups[owner], flag, default)


def _add(group: Any, flag: Flag, default: Any) -> None:
    required = default is dataclasses.MISSING
    help_ = flag.help if flag.positional else f"{flag.help} [env {flag.env}]"
    kwargs: dict[str, Any] = {"dest": flag.dest, "help": help_}
    if flag.kind is bool and flag.default is not False:  # --x / --no-x (None: the field decides)
        kwargs.update(action=argparse.BooleanOptionalAction, default=default)
    elif flag.kind is bool:
        kwargs.update(action="store_true", default=bool(default))
    elif flag.kind is tuple:
        kwargs.update(action=_Repeatable, default=list(default) if not required else [])
        kwargs["metavar"] = flag.option.lstrip("-").upper().replace("-", "_")
    else:
        kwargs.update(type=flag.kind, choices=flag.choices)
        if flag.choices is None:
            kwargs["metavar"] = flag.option.lstrip("-").upper().replace("-", "_")
        if not required:
            kwargs["default"] = default
        elif not flag.positional:
            kwargs["required"] = True
    if flag.positional:
        kwargs.pop("dest")
        kwargs["metavar"] = flag.dest.upper()
        group.add_argument(flag.dest, **kwargs)
        return
    names = [flag.short, flag.option] if flag.short else [flag.option]
    group.add_argument(*names, **kwargs)
    for alias in flag.aliases:  # same destination, hidden from --help
        group.add_argument(alias, **{**kwargs, "help": argparse.SUPPRESS, "required": False})


def _env_default(parser: argparse.ArgumentParser, flag: Flag, environ: Mapping[str, str]) -> Any:
    if flag.positional:  # arguments, not options: only the command line gives them
        return flag.default
    for option in (flag.option, *flag.aliases):
        raw = environ.get(env_name(option))
        if raw is None:
            continue
        try:
            return _convert(flag, raw)
        except (TypeError, ValueError) as e:
            parser.error(f"environment variable {env_name(option)}={raw!r}: {e}")
    return flag.default


def _convert(flag: Flag, raw: str) -> Any:
    if flag.kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        return word in _TRUE
    if flag.kind is tuple:
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    value = flag.kind(raw)
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"must be one of {', '.join(map(str, flag.choices))}")
    return value


def from_args(cls: type[S], args: argparse.Namespace, prefix: str = "") -> S:
    """Build the settings (nested ones included) from parsed flags."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        dest = prefix + field.name
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[field.name] = from_args(hint, args, dest + ".")
        elif hasattr(args, dest):
            value = getattr(args, dest)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def parse(
    cls: type[S], argv: Sequence[str], prog: str, environ: Mapping[str, str] | None = None
) -> S:
    """Parse `argv` into `cls` on a parser of its own (tests, embedding)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_settings(parser, cls, environ)
    return from_args(cls, parser.parse_args(list(argv)))
