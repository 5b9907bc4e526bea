"""Launch fix: vLLM's shared-memory queue waits by sleeping briefly instead of spinning on sched_yield.

vLLM's engine core and its workers talk through a shared-memory ring (`shm_broadcast.MessageQueue`).
A reader busy-waits with `os.sched_yield()` for 1 s after every message it read. On a small CPU host
every vLLM server then keeps two processes spinning (engine core and worker) for a second after each
step: with prefill and decode on two cores, four spinners starve the API servers, the other engine's
scheduler and the router. Measured here (1024-token prompts, sequential): P's prefill took 126 ms
instead of 50 ms and P/D TTFT doubled. `sched_yield` does not help under CFS, because the spinning
process stays runnable and keeps its share of the core.

With `KVFERRY_SHM_WAIT_SLEEP_S` set (`kvferry serve` and the local P/D stacks set 0.0001) each check
of the busy window sleeps that long instead: a reader still answers within ~0.1 ms, but a waiting
process uses a few percent of a core instead of all of it. The window itself is left at vLLM's 1 s:
shortening it makes readers fall back to vLLM's ZeroMQ wake-up, which can lose a wake-up under
quick successive writes and then stalls for its 5 s re-check (seen when it was tried).

Loaded in every vLLM process through the `vllm.general_plugins` entry point (pyproject.toml). Without
the variable it changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV_SHM_WAIT_SLEEP_S = "KVFERRY_SHM_WAIT_SLEEP_S"
DEFAULT_SLEEP_S = 0.0001
MAX_SLEEP_S = 0.01  # longer sleeps would add that much latency to every engine step


def sleep_from_env(environ: Mapping[str, str] = os.environ) -> float | None:
    """The configured sleep in seconds, None when unset or 0 (keep vLLM's sched_yield)."""
    raw = environ.get(ENV_SHM_WAIT_SLEEP_S)
    if raw is None or raw.strip() in ("", "0"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_SHM_WAIT_SLEEP_S}={raw!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SLEEP_S:
        raise ValueError(f"{ENV_SHM_WAIT_SLEEP_S}={raw!r} must be in (0, {MAX_SLEEP_S}] seconds")
    return value


def register() -> None:
    """vLLM general-plugin hook; runs once per vLLM process."""
    sleep_s = sleep_from_env()
    if sleep_s is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not callable(getattr(shm_broadcast, "sched_yield", None)):
        log.warning("kvferry: vLLM's shm_broadcast has no sched_yield; %s ignored", ENV_SHM_WAIT_SLEEP_S)
        return
    # The module looks the name up at each call, so this also covers queues created before now.
    shm_broadcast.sched_yield = functools.partial(time.sleep, sleep_s)
