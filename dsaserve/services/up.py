"""`dsaserve up`: the whole disaggregated stack on this machine, in one command.

Starts a private redis-server (unless --redis-url is given), one prefill and one decode
worker, and the router, all on loopback; waits until the router reports healthy; prints
the URL and a curl example. SIGINT/SIGTERM stops every child, and every child also dies
with this process (PR_SET_PDEATHSIG), so nothing is left behind.

On GPUs (--device cuda) each worker is a GPU group of its own, seeing only its GPUs
(CUDA_VISIBLE_DEVICES): --prefill-devices/--decode-devices name them, --prefill-tp/--decode-tp
(or --tensor-parallel-size for both) size them; by default the visible GPUs are split in half,
prefill first, each half as large a group as the model splits into.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from dsaserve.engine.config import EngineConfig, setting
from dsaserve.engine.demo_model import DEMO_MODEL_DIR
from dsaserve.engine.ports import free_port
from dsaserve.services import redis_server, settings

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class UpSettings:
    """Local stack"""

    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str | None = setting(None, "model directory (default: the built-in demo model)")
    port: int = setting(8000, "router HTTP port")
    host: str = setting("127.0.0.1", "router bind address")
    redis_url: str | None = setting(
        None, "use this Redis instead of starting a private redis-server"
    )
    api_keys: tuple[str, ...] = setting((), "require this API key (repeatable)", flag="--api-key")
    startup_timeout: float = setting(600.0, "seconds to wait for the stack to become healthy")
    prefill_tp: int | None = setting(
        None,
        "tensor-parallel size of the prefill worker (default: --tensor-parallel-size when given, "
        "else the number of --prefill-devices, else half the visible GPUs)",
    )
    decode_tp: int | None = setting(None, "tensor-parallel size of the decode worker (likewise)")
    prefill_devices: tuple[str, ...] = setting(
        (), "GPUs of the prefill worker (CUDA_VISIBLE_DEVICES entries, e.g. 0,1)"
    )
    decode_devices: tuple[str, ...] = setting(
        (), "GPUs of the decode worker (default: the visible GPUs after the prefill worker's)"
    )
    stream_interval: int = setting(1, "new tokens per streamed message (the decode worker's flag)")


Settings = UpSettings


@dataclass(frozen=True)
class Placement:
    """Where one worker runs: its tensor-parallel size and the GPUs it sees (none on the CPU)."""

    tp: int
    devices: tuple[str, ...] = ()


def place(s: UpSettings, visible: list[str], splits: Callable[[int], bool]) -> dict[str, Placement]:
    """The prefill and the decode worker's placements on the `visible` GPUs; splits(n): whether
    the model can be split over n ranks."""
    asked = {
        "prefill": (s.prefill_tp, _gpus(s.prefill_devices)),
        "decode": (s.decode_tp, _gpus(s.decode_devices)),
    }
    given = s.engine.tensor_parallel_size if s.engine.tensor_parallel_size > 1 else None
    if s.engine.device != "cuda":
        return {role: Placement(tp or given or 1) for role, (tp, _) in asked.items()}
    half = max(1, len(visible) // 2)
    default = max(n for n in range(1, half + 1) if splits(n))
    taken = asked["prefill"][1] + asked["decode"][1]
    out, free = {}, [d for d in visible if d not in taken]
    for role, (tp, devices) in asked.items():
        tp = tp or given or (len(devices) if devices else default)
        if not devices:
            if len(free) < tp and len(visible) == 1 and tp == 1:
                free = list(visible)  # one GPU: both workers share it
            if len(free) < tp:
                raise SystemExit(
                    f"the {role} worker needs {tp} GPUs but only {len(free)} of the visible "
                    f"{visible} are left; pass --{role}-devices or a smaller --{role}-tp"
                )
            devices, free = tuple(free[:tp]), free[tp:]
        if len(devices) != tp:
            raise SystemExit(
                f"--{role}-devices names {len(devices)} GPUs for a tensor-parallel size of {tp}"
            )
        out[role] = Placement(tp, tuple(devices))
    return out


def _gpus(entries: tuple[str, ...]) -> tuple[str, ...]:
    """`--prefill-devices 0,1` and `--prefill-devices 0 --prefill-devices 1` alike."""
    return tuple(d.strip() for entry in entries for d in entry.split(",") if d.strip())


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def model_splits(model: str, engine: EngineConfig) -> Callable[[int], bool]:
    """Whether the model in `model`, run as `engine` says, splits over n ranks."""
    from dsaserve.engine.model_dir import ConfigError
    from dsaserve.engine.models import family
    from dsaserve.engine.rank import keeps_quantized

    cfg = family(model).ModelConfig.from_dir(model)

    def splits(n: int) -> bool:
        try:
            cfg.check_tensor_parallel(n, keeps_quantized(engine, cfg))
        except ConfigError:
            return False
        return True

    return splits


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line flags that give a worker `config` (defaults left out)."""
    argv = []
    for flag in settings.flags(EngineConfig):
        value = getattr(config, flag.dest)
        if value == flag.default:
            continue
        if flag.kind is bool:  # (a switch that defaults on is turned off by its --no- form)
            argv.append(flag.option if value else "--no-" + flag.option.removeprefix("--"))
        else:
            argv += [flag.option, str(value)]
    return argv


class Stack:
    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen]] = []

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, stdin: str = ""
    ) -> None:
        """Start a child; `stdin` is written to its standard input, then closed."""
        from dsaserve.engine.parallel.launch import die_with_parent

        log.info("starting %s: %s", name, " ".join(argv))
        proc = subprocess.Popen(
            argv, env=env, preexec_fn=die_with_parent, stdin=subprocess.PIPE if stdin else None
        )
        if proc.stdin is not None:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        self.children.append((name, proc))

    def check(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with code {proc.returncode}; see its log above")

    def stop(self) -> None:
        for _, proc in reversed(self.children):  # router first, redis last
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


def run(s: UpSettings) -> None:
    model = s.model or str(DEMO_MODEL_DIR)
    token = secrets.token_hex(16)
    stack = Stack()
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        redis_url = s.redis_url
        if redis_url is None:
            port, password = free_port(), secrets.token_hex(16)
            try:
                argv = redis_server.command(port, "--loglevel", "warning", config_on_stdin=True)
            except redis_server.RedisNotFound as e:
                raise SystemExit(f"{e} or pass --redis-url") from None
            stack.spawn("redis", argv, stdin=redis_server.config(password))
            redis_url = redis_server.url(port, password)
        dsaserve = [sys.executable, "-m", "dsaserve.services.cli"]
        common = ["--model", model]
        # Secrets go to the children in their environment, not on command lines (ps shows those).
        env = {
            **os.environ,
            "DSASERVE_CLUSTER_TOKEN": token,
            "DSASERVE_REDIS_URL": redis_url,
            "DSASERVE_API_KEY": ",".join(s.api_keys),
        }
        visible = visible_gpus() if s.engine.device == "cuda" else []
        placements = place(s, visible, model_splits(model, s.engine))
        metrics = {role: free_port() for role in ROLES}
        for role in ROLES:
            where = placements[role]
            gpus = f"GPUs {','.join(where.devices)}" if where.devices else s.engine.device
            log.info("%s worker: tensor-parallel %d on %s", role, where.tp, gpus)
            engine = dataclasses.replace(s.engine, tensor_parallel_size=where.tp)
            sees = {"CUDA_VISIBLE_DEVICES": ",".join(where.devices)} if where.devices else {}
            own = ["--stream-interval", str(s.stream_interval)] if role == "decode" else []
            stack.spawn(
                role,
                dsaserve
                + [role]
                + common
                + engine_flags(engine)
                + own
                + ["--host", "127.0.0.1"]
                + ["--port", str(free_port()), "--metrics-port", str(metrics[role])],
                {**env, **sees},
            )
        router = []
        if s.engine.max_model_len:
            router += ["--max-model-len", str(s.engine.max_model_len)]
        stack.spawn(
            "router",
            dsaserve + ["router", "--host", s.host, "--port", str(s.port)] + common + router,
            env,
        )
        url = f"http://{'127.0.0.1' if s.host in ('0.0.0.0', '::') else s.host}:{s.port}"
        _wait_healthy(url, stack, s.startup_timeout, lambda: stopping)
        if not stopping:
            _print_banner(url, model, s.api_keys, metrics)
        while not stopping:
            stack.check()
            time.sleep(0.2)
    finally:
        stack.stop()


def _wait_healthy(url: str, stack: Stack, timeout: float, stopping: Callable[[], bool]) -> None:
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


def _print_banner(url: str, model: str, api_keys: tuple[str, ...], metrics: dict[str, int]) -> None:
    name = os.path.basename(os.path.normpath(model))
    auth = f" -H 'Authorization: Bearer {api_keys[0]}'" if api_keys else ""
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    print(
        f"\ndsaserve is up: {url}  (model {name!r}; Ctrl-C stops everything)\n"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'\n"
        + "".join(
            f"  {role} worker metrics: http://127.0.0.1:{port}/metrics\n"
            for role, port in metrics.items()
        ),
        flush=True,
    )
