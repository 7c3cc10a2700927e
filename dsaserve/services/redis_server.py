"""A private redis-server on a loopback port: what `dsaserve up` starts when it is given no
--redis-url, and what the tests run their registries on.

Loopback only, nothing persisted (no RDB snapshots, no append-only file): the registry's
records live as long as their TTLs, so a restarted Redis loses nothing the workers do not
write again at their next heartbeat. `dsaserve up` also gives it a password, in a config read
from stdin (`config(password)`), never on the command line where `ps` shows it.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

HOST = "127.0.0.1"


class RedisNotFound(RuntimeError):
    """No redis-server binary on PATH."""


def binary() -> str:
    """The redis-server to run, or RedisNotFound saying how to install one."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisNotFound("redis-server not found: install it (apt-get install redis-server)")
    return path


def command(port: int, *options: str, config_on_stdin: bool = False) -> list[str]:
    """The command line of a private redis-server on `port`, plus redis-server `options`;
    `config_on_stdin`: it reads more config (`config(...)`) from its stdin."""
    return [
        binary(),
        *(["-"] if config_on_stdin else []),
        "--port",
        str(port),
        "--bind",
        HOST,
        "--save",
        "",
        "--appendonly",
        "no",
        *options,
    ]


def config(password: str) -> str:
    """Config lines that make clients authenticate with `password` (Redis's AUTH)."""
    return f"requirepass {password}\n"


def url(port: int, password: str | None = None) -> str:
    return f"redis://{f':{password}@' if password else ''}{HOST}:{port}/0"


def wait_ready(proc: subprocess.Popen[bytes], redis_url: str, timeout_s: float) -> bool:
    """Ping the server started as `proc` until it answers (True), exits or `timeout_s` passes
    (False)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                return True
            except redis.ConnectionError:
                time.sleep(0.02)  # polling a readiness condition, bounded by the deadline
    finally:
        client.close()
    return False
