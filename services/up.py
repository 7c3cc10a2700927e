"""`dsaserve up`: the whole disaggregated stack on this machine, in one command.

Starts a private redis-server (unless --redis-url is given), one prefill and one decode
worker, and the router, all on loopback; waits until the router reports healthy; prints
the URL and a curl example. SIGINT/SIGTERM stops every child, and every child also dies
with this process (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--port", type=int, default=8000, help="router HTTP port")
    parser.add_argument("--host", default="127.0.0.1", help="router bind address")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private redis-server")
    parser.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--startup-timeout", type=float, default=600.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Stack:
    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log.info("starting %s: %s", name, " ".join(argv))
        self.children.append((name, subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)))

    def check(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with code {proc.returncode}; see its log above")

    def stop(self) -> None:
        for name, proc in reversed(self.children):   # router first, redis last
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for name, proc in reversed(self.children):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace) -> None:
    from engine.tiny_model import default_tiny_model_dir

    model = args.model or str(default_tiny_model_dir())   # made once here, not raced by two workers
    token = secrets.token_hex(16)
    stack = Stack()
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        redis_url = args.redis_url
        if redis_url is None:
            binary = shutil.which("redis-server")
            if binary is None:
                raise SystemExit("redis-server not found: install it (apt-get install redis-server) or pass --redis-url")
            port = _free_port()
            stack.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                  "no", "--loglevel", "warning"])
            redis_url = f"redis://127.0.0.1:{port}/0"
        dsaserve = [sys.executable, "-m", "services.cli"]
        common = ["--model", model, "--redis-url", redis_url]
        env = {**os.environ, "DSASERVE_CLUSTER_TOKEN": token}   # not on command lines, where ps shows it
        engine = ["--device", args.device, "--dtype", args.dtype, "--host", "127.0.0.1"]
        if args.kv_cache_memory:
            engine += ["--kv-cache-memory", str(args.kv_cache_memory)]
        for role in ("prefill", "decode"):
            stack.spawn(role, dsaserve + [role] + common + engine + [
                "--port", str(_free_port()), "--metrics-port", str(_free_port())], env)
        keys = [a for key in args.api_key for a in ("--api-key", key)]
        stack.spawn("router", dsaserve + ["router", "--host", args.host, "--port", str(args.port)] + common + keys, env)
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        _wait_healthy(url, stack, args.startup_timeout, lambda: stopping)
        if not stopping:
            _print_banner(url, model, args.api_key)
        while not stopping:
            stack.check()
            time.sleep(0.2)
    finally:
        stack.stop()


def _wait_healthy(url: str, stack: Stack, timeout: float, stopping) -> None:
    deadline = time.monotonic() + timeout
    while not stopping():
        stack.check()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the stack did not become healthy within {timeout:.0f} s")
        time.sleep(0.25)


def _print_banner(url: str, model: str, api_keys: list[str]) -> None:
    name = os.path.basename(os.path.normpath(model))
    auth = f" -H 'Authorization: Bearer {api_keys[0]}'" if api_keys else ""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    print(f"\ndsaserve is up: {url}  (model {name!r}; Ctrl-C stops everything)\n"
          f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n", flush=True)
