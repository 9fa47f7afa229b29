"""An Envoy started by a test or benchmark dies with its parent, even when the parent is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from .stack import eventually

SCRIPT = """
import asyncio
from epp.testing.envoy import EnvoyConfig, EnvoyProcess
async def main():
    envoy = EnvoyProcess(EnvoyConfig(ext_proc=False))
    await envoy.start()
    print(envoy.pid, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_envoy_dies_when_its_parent_is_killed() -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRIPT, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    line = await asyncio.wait_for(parent.stdout.readline(), 30)
    envoy_pid = int(line)
    assert alive(envoy_pid)
    parent.send_signal(signal.SIGKILL)
    await parent.wait()
    await eventually(lambda: not alive(envoy_pid), "envoy gone after its parent was killed")
