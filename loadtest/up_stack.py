"""`dsaserve up` as a child process, for what measures or tests the stack a user starts: its
router's URL and its workers' metrics, as its banner prints them; stopped with SIGTERM (every
child of `up` stops with it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from dsaserve.engine.ports import free_port

BANNER = re.compile(r"dsaserve is up: (\S+)")
METRICS = re.compile(r"(\w+) worker metrics: (\S+)")


class UpStack:
    def __init__(self, flags: Sequence[str], log: Path, timeout_s: float = 600.0) -> None:
        """flags: `dsaserve up`'s own (a free --port is added); log: where its output goes."""
        port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsaserve.services.cli", "up", "--port", str(port), *flags],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url, self.metrics_urls = "", dict[str, str]()
        deadline = time.monotonic() + timeout_s
        while not self.metrics_urls:
            text = log.read_text()
            if (m := BANNER.search(text)) and len(METRICS.findall(text)) == 2:
                self.url, self.metrics_urls = m.group(1), dict(METRICS.findall(text))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dsaserve up did not come up:\n{text[-3000:]}")
            else:
                time.sleep(0.2)  # (polling its log for the banner, under the deadline)

    def metric(self, role: str, name: str, **labels: str) -> float:
        """A worker's metric (summed over its series with these labels; 0 before the first)."""
        with urllib.request.urlopen(self.metrics_urls[role], timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            series, _, tags = head.partition("{")
            if series == name and all(f'{k}="{v}"' in tags for k, v in labels.items()):
                total += float(value)
        return total

    def idle(self) -> bool:
        """No request left on either worker, every KV page free or only the cache's."""
        for role in self.metrics_urls:
            pages = [
                self.metric(role, f"dsaserve_kv_pages_{k}") for k in ("free", "cached", "total")
            ]
            busy = sum(
                self.metric(role, f"dsaserve_requests_{k}") for k in ("running", "waiting", "held")
            )
            if busy or pages[0] + pages[1] != pages[2]:
                return False
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> UpStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
