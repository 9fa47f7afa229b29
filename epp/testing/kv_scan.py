"""The compiled scan of KV-event batches checked against `decode_batch`, for tests and fuzzing: a batch
the scan takes must read exactly as `decode_batch` reads it, and a batch `decode_batch` rejects must be
left to it."""

from __future__ import annotations

from typing import Any

from epp.kvindex.batch_reader import runs_of
from epp.kvindex.event_scan import REMOVED, STORED, ScannedBatch, scan_batch
from epp.kvindex.events import DecodeError, decode_batch

_M64 = (1 << 64) - 1


def flat(batch: ScannedBatch) -> tuple[Any, ...]:
    """A batch as one tuple per event (a BlockRemoved as one per hash: runs merge them), tokens as uint64."""
    out: list[Any] = []
    for run in batch.runs:
        if run[0] == STORED:
            _, tier, lora, salt, hashes, parents, per, tokens, tper, sizes, array = run  # type: ignore[misc]
            if array is not None and array.tolist() != hashes:
                raise AssertionError(f"the scan's hash array {array!r} is not its hashes {hashes!r}")
            ids = [int(t) & _M64 for t in tokens]
            h = t = 0
            for parent, n, nt, ebs in zip(parents, per, tper, sizes, strict=True):
                out.append(
                    ("S", tuple(hashes[h : h + n]), parent, tuple(ids[t : t + nt]), ebs, tier, lora, salt)
                )
                h += n
                t += nt
        elif run[0] == REMOVED:
            out.extend(("R", x, run[1], run[3]) for x in run[2])  # type: ignore[misc,union-attr]
        else:
            out.append(("C",))
    return (
        repr(batch.ts),
        batch.data_parallel_rank,
        batch.events,
        batch.skipped,
        batch.partial_groups,
        tuple(out),
    )  # (repr: nan == nan)


def same_reading(payload: bytes) -> ScannedBatch | None:
    """Scan `payload`; raise AssertionError if the scan takes it but `decode_batch` reads it differently
    or rejects it. Returns the scan's reading (None: left to `decode_batch`)."""
    scanned = scan_batch(payload)
    try:
        reference = runs_of(decode_batch(payload))
    except DecodeError as e:
        if scanned is not None:
            raise AssertionError(
                f"the scan took a batch decode_batch rejects ({e}): {payload!r:.300}"
            ) from None
        return None
    if scanned is not None and flat(scanned) != flat(reference):
        raise AssertionError(f"the scan reads a batch differently from decode_batch: {payload!r:.300}")
    return scanned
