"""`dsaserve`: one command for every process of the stack.

    dsaserve up                      local stack: redis, router, one prefill and one decode worker
    dsaserve router|prefill|decode   one service each (compose, Kubernetes)
    dsaserve generate                offline generation with the engine
    dsaserve make-tiny-model DIR     a tiny random DeepSeek-V4 checkpoint
    dsaserve profile                 the decode step by kernel class and model part, vs floors

Each command's module exposes `Settings` (a dataclass: its flags and DSASERVE_* variables come
from it, see services/settings.py) and `run(settings)`. Modules are imported per command, so
`dsaserve router` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from dsaserve.services import settings

# command -> (module with Settings and run, help)
COMMANDS = {
    "up": ("dsaserve.services.up", "run the whole stack locally"),
    "router": ("dsaserve.services.router.main", "the OpenAI-compatible HTTP router"),
    "prefill": ("dsaserve.services.prefill.main", "a prefill worker (gRPC)"),
    "decode": ("dsaserve.services.decode.main", "a decode worker (gRPC)"),
    "generate": ("dsaserve.services.generate", "generate offline with the engine"),
    "make-tiny-model": (
        "dsaserve.services.make_tiny_model",
        "write a tiny random DeepSeek-V4 checkpoint",
    ),
    "profile": (
        "dsaserve.services.profile",
        "profile the decode step: time by kernel class and model part against its floors",
    ),
}


def command_module(command: str) -> ModuleType:
    return importlib.import_module(COMMANDS[command][0])


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsaserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == command:  # import only the module of the command being run
            settings.add_settings(p, command_module(name).Settings)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    module = command_module(args.command)
    try:
        config = settings.from_args(module.Settings, args)
    except ValueError as e:  # a setting's own check (__post_init__)
        parser.error(str(e))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    module.run(config)


if __name__ == "__main__":
    main()
