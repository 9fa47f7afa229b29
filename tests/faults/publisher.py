"""An engine's KV-event publisher in a process of its own, so a test can really kill it (SIGKILL),
freeze it (SIGSTOP: a hung engine, or a node gone without closing its connections) or flood the
EPP from outside the EPP's own memory.

The child (`python -m tests.faults.publisher`) runs `epp.testing.kv_publisher.KvEventPublisher` and
reads one JSON command per line on stdin, answering `ok <next seq>` on stdout:

- `{"op": "store", "hashes": [...], "parent": h|null, "tokens": [...], "send": true}`: one BlockStored;
- `{"op": "empty", "send": true}`: an empty batch (`send: false` buffers it for replay only: lost);
- `{"op": "storm", "batches": N, "blocks": K, "cycle": C}`: N batches of K chained blocks with large
  token ids, cycling through C pre-encoded batches (the first of each cycle clears the engine's
  blocks), published as fast as the socket takes them (the PUB drops at its high-water mark).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BS = 16


class PublisherProcess:
    """The parent's handle on a child publisher."""

    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "", sndhwm: int | None = None
    ) -> None:
        self.argv = [sys.executable, "-m", "tests.faults.publisher", "--endpoint", endpoint, "--topic", topic]
        if replay_endpoint is not None:
            self.argv += ["--replay", replay_endpoint]
        if sndhwm is not None:
            self.argv += ["--sndhwm", str(sndhwm)]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> PublisherProcess:
        from epp.testing.envoy import die_with_parent

        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        line = await self._line(30.0)
        if line != "ready":
            raise RuntimeError(f"publisher process did not start: {line!r}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def _line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        return raw.decode().strip()

    async def command(self, timeout: float = 60.0, **cmd: Any) -> int:
        """Run one command; returns the publisher's next seq."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self._line(timeout)
        if not line.startswith("ok "):
            raise RuntimeError(f"publisher command {cmd.get('op')!r} failed: {line!r}")
        return int(line.split()[1])

    async def store(self, hashes: list[int], parent: int | None, tokens: list[int], send: bool = True) -> int:
        return await self.command(op="store", hashes=hashes, parent=parent, tokens=tokens, send=send)

    async def empty(self, send: bool = True) -> int:
        return await self.command(op="empty", send=send)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL, as an engine crash or an OOM kill: the kernel closes its sockets."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await asyncio.wait_for(self.proc.wait(), 10.0)

    async def __aenter__(self) -> PublisherProcess:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a frozen child must run to die on SIGTERM
        await self.kill()


# -- the child ---------------------------------------------------------------------------


async def _child(args: argparse.Namespace) -> None:
    import zmq

    from epp.testing.kv_publisher import KvEventPublisher, cleared, encode_batch, stored

    pub = KvEventPublisher(args.endpoint, replay_endpoint=args.replay, topic=args.topic)
    if args.sndhwm is not None:
        pub.pub.setsockopt(zmq.SNDHWM, args.sndhwm)
    await pub.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "store":
                event = stored(cmd["hashes"], cmd["parent"], cmd["tokens"], BS)
                await pub.publish([event], send=cmd.get("send", True))
            elif op == "empty":
                await pub.publish([], send=cmd.get("send", True))
            elif op == "storm":
                # A cycle of pre-encoded batches (each cycle starts with AllBlocksCleared, so the engine's
                # state is always the current cycle's blocks), sent as fast as the socket takes them.
                k, cycle = cmd["blocks"], cmd.get("cycle", 64)
                payloads = []
                for c in range(cycle):
                    base = 1 + c * k
                    toks = [100_000 + (base * BS + j) % 50_000 for j in range(k * BS)]
                    events = [stored(list(range(base, base + k)), None, toks, BS)]
                    payloads.append(encode_batch([cleared(), *events] if c == 0 else events))
                for i in range(cmd["batches"]):
                    await pub.publish([], payload=payloads[i % cycle])
                    if i % 256 == 0:
                        await asyncio.sleep(0)  # let the replay socket answer
            else:
                out.write(f"error unknown op {op!r}\n")
                out.flush()
                continue
            out.write(f"ok {pub.seq}\n")
            out.flush()
    finally:
        await pub.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay")
    p.add_argument("--topic", default="")
    p.add_argument("--sndhwm", type=int)
    asyncio.run(_child(p.parse_args()))


if __name__ == "__main__":
    main()
