"""`dsaserve`: one command for every process of the stack.

    dsaserve up                  local stack: redis, router, one prefill and one decode worker
    dsaserve router|prefill|decode   one service each (compose, Kubernetes)
    dsaserve generate            offline generation with the engine
    dsaserve make-tiny-model DIR the built-in tiny demo checkpoint

Every flag can also come from a DSASERVE_* environment variable. Modules are imported per
command, so `dsaserve router` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from services.flags import env_defaults

# command -> (module, function adding its arguments, function running it, help)
COMMANDS = {
    "up": ("services.up", "add_arguments", "run", "run the whole stack locally"),
    "router": ("services.router.main", "add_arguments", "run", "the OpenAI-compatible HTTP router"),
    "prefill": ("services.worker", "add_prefill_arguments", "run_prefill", "a prefill worker (gRPC)"),
    "decode": ("services.worker", "add_decode_arguments", "run_decode", "a decode worker (gRPC)"),
    "generate": ("engine.cli", "add_generate_arguments", "run_generate", "generate offline with the engine"),
    "make-tiny-model": ("engine.cli", "add_make_tiny_model_arguments", "run_make_tiny_model",
                        "write the built-in tiny DeepSeek-V4 checkpoint"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsaserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add, _, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == command:   # import only the module of the command being run
            getattr(importlib.import_module(module), add)(p)
            env_defaults(p)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module, _, run, _ = COMMANDS[args.command]
    getattr(importlib.import_module(module), run)(args)


if __name__ == "__main__":
    main()
