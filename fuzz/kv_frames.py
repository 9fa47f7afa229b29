"""Fuzz target: KV-event messages (frames split at `seeds.FRAME_SEP`) into `KvEventSubscriber.handle`,
per-pod or central (the first byte chooses). Every message must be applied or dropped under one reason;
an exception or an uncounted message is a finding, and so is a payload the compiled scan reads otherwise
than `decode_batch` (`epp.testing.kv_scan`). Run with `python fuzz/run.py kv_frames SECONDS`."""

from __future__ import annotations

import sys

import atheris

from fuzz import COMPILED

with atheris.instrument_imports(include=["epp", "fuzz"], exclude=COMPILED):
    from epp.clock import MonotonicClock
    from epp.config import KvEventsConfig
    from epp.datastore import Datastore
    from epp.kvindex.freshness import FreshnessTracker
    from epp.kvindex.index import BlockIndex
    from epp.kvindex.ingest import KvIngest
    from epp.sources.kv_events import KvEventSubscriber
    from epp.testing.kv_scan import same_reading
    from fuzz.seeds import FRAME_SEP

POD = "10.0.0.1:8000"
CLOCK = MonotonicClock()
DATASTORE = Datastore(CLOCK)
DATASTORE.add_endpoint(POD, "m")
INDEX = BlockIndex(block_size=16, max_entries=200_000)
INGEST = KvIngest(INDEX, FreshnessTracker(), lambda pod: "m")
SUBSCRIBER = KvEventSubscriber(DATASTORE, INGEST, CLOCK, KvEventsConfig(mode="per-pod"))


def outcomes() -> int:
    return sum(c.messages + sum(c.drops.values()) for c in INGEST.counters.values())


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    central = data[0] & 1
    frames = data[1:].split(FRAME_SEP)
    if len(frames) == 3:
        same_reading(frames[2])  # the compiled scan takes only what decode_batch reads the same way
    before = outcomes()
    SUBSCRIBER.handle(frames, None if central else POD, -1 if central else 0)
    if outcomes() != before + 1:
        raise AssertionError(f"a message was neither applied nor counted as a drop: {frames!r:.200}")
    INDEX.flush()


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
