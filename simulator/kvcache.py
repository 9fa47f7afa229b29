"""The engine's KV cache manager (vLLM's `KVCacheManager`): request block tables over the block pool,
the CPU tier and the KV events. Pure.

The scheduler (`scheduler.py`, driven by `engine.py`) decides who runs; this module takes and releases
blocks for it:

- `new_request` hashes a request's blocks once (prompt and the generated tokens it will feed back,
  `hashing.py`, chained from a root per LoRA adapter and cache salt);
- `admit` finds the prefix hit (GPU run, capped at floor((len - 1) / block_size) blocks, then the
  CPU tier's continuation, in whole blocks up to the prompt's end), takes the hit blocks and
  allocates the rest of the first chunk's blocks; it refuses (the scheduler keeps the request
  waiting) unless the blocks of the *whole* sequence fit, as vLLM's admission gate
  (`allocate_slots(..., full_sequence_must_fit=True)`, its default `scheduler_reserve_full_isl`): the
  blocks its tokens need beyond the GPU hit, plus the hit blocks that sit in the free queue (touching
  them takes them from it), at most the free blocks.
  Only the first chunk's blocks are taken; the rest come chunk by chunk (`grow`), so a running
  request can still be preempted for them. A request the CPU tier continues is not scheduled: the
  blocks to load its continuation into are allocated (uncached) and the engine waits for the load;
- `grow` allocates the blocks a chunk or a decode token reaches (False when too few are free: the
  scheduler preempts and retries);
- `cache_full` hashes and caches the blocks the scheduled tokens fill, as vLLM's `allocate_slots`
  does when it schedules them, with one `BlockStored` for them;
- `free` releases a request's blocks in reverse order.

The CPU tier, when there is one (`offload.py`), takes a block as `cache_full` caches it on the GPU
(write-through, vLLM's `OffloadingConnector`: the CPU's `BlockStored` right after the GPU's, in the
same batch; a block the GPU evicts later is only `BlockRemoved` there), or, with `write_through` off
(SGLang HiCache's `write_back`), when an allocation evicts it from the GPU: per block, the CPU tier's
`BlockStored` (with the block's parent hash, token ids, adapter and salt, kept per block for this) is
emitted before the GPU's `BlockRemoved`, so an index receiving the events always knows the parent of
what it stores. Either way a full CPU tier drops its least recently used block (`BlockRemoved`, CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from simulator.blocks import BlockPool, Ids
from simulator.events import CPU, GPU, EventSink
from simulator.hashing import block_hashes, root_hash
from simulator.offload import CpuTier

if TYPE_CHECKING:
    from simulator.records import RequestRecord

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
LOADING, LOADED = 4, 5  # its CPU-tier hit being loaded; the load reported finished, not yet scheduled


class ReqState:
    """One request inside an engine: its tokens and block table (this module) and its scheduling
    state (`scheduler.py`, `decode_batch.py`: phase, admission order, and where its decoding started)."""

    __slots__ = (
        "_hashes",
        "c0",
        "computed",
        "epoch",
        "lora",
        "max_tokens",
        "nblocks",
        "ncached",
        "o0",
        "order",
        "outputs",
        "phase",
        "prompt_len",
        "ready_s",
        "rec",
        "s0",
        "s_fin",
        "salt",
        "table",
        "tag",
        "target",
        "tokens",
        "values",
    )

    def __init__(
        self,
        rec: RequestRecord,
        tokens: npt.NDArray[np.int64],
        values: npt.NDArray[np.uint64],
        tag: int,
        max_blocks: int,
    ) -> None:
        req = rec.request
        self.rec = rec
        self.tokens = tokens  # prompt + the outputs that are fed back (all but the last)
        self.values = values  # hashes of the full blocks of `tokens`
        self._hashes: list[int] | None = None
        self.prompt_len = rec.prompt_tokens
        self.max_tokens = req.max_tokens
        self.salt = req.cache_salt
        self.lora = req.lora_name
        self.tag = tag  # chain (adapter, salt) id
        self.table: Ids = np.zeros(max_blocks, dtype=np.int64)  # the block ids it holds, in order
        self.nblocks = 0  # blocks held (table[:nblocks])
        self.ncached = 0  # of them, full and cached (vLLM's num_cached_block)
        self.computed = 0  # tokens whose KV is computed (or hit)
        self.outputs = 0
        self.target = self.prompt_len  # tokens to prefill: the prompt, plus outputs after a preemption
        self.phase = WAITING
        self.order = self.epoch = self.s0 = self.c0 = self.o0 = self.s_fin = 0
        self.ready_s = 0.0  # LOADING: when its CPU-tier load ends

    @property
    def hashes(self) -> list[int]:
        """`values` as Python ints (made on first use: the CPU tier's calls)."""
        if self._hashes is None:
            self._hashes = self.values.tolist()
        return self._hashes


class KvCacheManager:
    __slots__ = (
        "_bfirst",
        "_bparent",
        "_btag",
        "_btok",
        "_chains",
        "_roots",
        "_write_through",
        "block_size",
        "cpu",
        "pool",
        "sink",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cpu_blocks: int,
        sink: EventSink | None,
        write_through: bool = True,
    ) -> None:
        self.block_size = bs = block_size
        self.pool = BlockPool(num_blocks, bs)
        self.cpu = CpuTier(cpu_blocks) if cpu_blocks else None
        self._write_through = write_through and self.cpu is not None
        self.sink = sink
        if self.cpu is not None:  # what a CPU-tier event needs about an evicted GPU block
            self._bparent = np.zeros(num_blocks, dtype=np.uint64)
            self._bfirst = np.zeros(num_blocks, dtype=np.bool_)
            self._btag = np.zeros(num_blocks, dtype=np.int64)
            self._btok = np.zeros((num_blocks, bs), dtype=np.int64)
        self._chains: list[tuple[str | None, str | None]] = []  # tag -> (lora, salt)
        self._roots: dict[tuple[str | None, str | None], tuple[int, int]] = {}  # -> (root hash, tag)

    def _root(self, lora: str | None, salt: str | None) -> tuple[int, int]:
        key = (lora, salt or None)
        got = self._roots.get(key)
        if got is None:
            got = self._roots[key] = (root_hash(lora, salt), len(self._chains))
            self._chains.append(key)
        return got

    def new_request(self, rec: RequestRecord, tokens: npt.NDArray[np.int64]) -> ReqState:
        req = rec.request
        root, tag = self._root(req.lora_name, req.cache_salt)
        bs = self.block_size
        return ReqState(rec, tokens, block_hashes(tokens, bs, root), tag, -(-len(tokens) // bs))

    def probe(self, tokens: npt.NDArray[np.int64], salt: str | None, lora: str | None) -> tuple[int, int]:
        """(GPU prefix tokens, CPU continuation tokens) held for `tokens`, uncapped."""
        bs = self.block_size
        root, _ = self._root(lora, salt)
        values = block_hashes(tokens, bs, root)
        nh = len(self.pool.lookup_ids(values, len(values)))
        nc = self.cpu.run(values.tolist(), nh, len(values)) if self.cpu is not None else 0
        return nh * bs, nc * bs

    def admit(
        self,
        r: ReqState,
        budget: int,
        reserved: Callable[[], int] | None = None,
        held_back: int = 0,
        freed: Collection[int] = (),
    ) -> tuple[int, int, int] | None:
        """Take r's prefix hit and the blocks of its first chunk (at most `budget` tokens): (GPU hit blocks,
        CPU-tier blocks, chunk tokens), with r.computed = the hit; None (nothing taken) unless the whole
        sequence's blocks fit (see the module docstring). r holds no blocks.

        With a CPU-tier continuation (nc > 0) no chunk is scheduled (chunk 0): vLLM's asynchronous load (the
        offloading connector's `load_kv_async`). The hit blocks are taken and nc blocks allocated for the
        load, not cached until it has ended (`allocate_slots(..., delay_cache_blocks=True)`; `cache_full`
        then), and r.computed counts them. Besides the whole-sequence gate the nc blocks must fit beside
        `reserved()`, the blocks that the in-flight prefills and loads still need (vLLM's
        `reserved_blocks`). `held_back` free blocks are left out of every fit (async scheduling: what
        the requests that ended with the step before freed, which vLLM had not freed yet when it
        scheduled this step), but for the hit blocks among them (`freed`): vLLM's lookup found those
        in use, not in the free queue."""
        bs = self.block_size
        pool = self.pool
        n = r.target  # vLLM's request.num_tokens: the prompt, and the outputs after a preemption
        limit = (n - 1) // bs  # vLLM always computes at least one prompt token
        hit_ids = pool.lookup_ids(r.values, limit)
        nh = len(hit_ids)
        if held_back and nh and freed:
            held_back = max(held_back - sum(1 for b in hit_ids.tolist() if b in freed), 0)
        cpu = self.cpu
        # the connector looks up whole blocks up to the prompt's end; a load that covers the whole prompt
        # leaves its last token to compute (`cpu_loads.LoadQueue.schedule`)
        nc = cpu.run(r.hashes, nh, n // bs) if cpu is not None and nh < n // bs else 0
        full = -(-n // bs) - nh  # the gate: every block past the GPU hit (CPU-tier blocks need GPU ones)
        if nc:
            computed = (nh + nc) * bs
            chunk = 0
            need = nc
            fit = (max(full, nc + reserved()) if reserved is not None else full) + held_back
        else:
            computed = nh * bs
            chunk = min(n - computed, budget)
            need = -(-(computed + chunk) // bs) - nh
            fit = full + held_back
        table = r.table
        if nh:  # plus the hit blocks that touching takes out of the free queue
            if not pool.touch_if_fits(hit_ids, fit):
                return None
            table[:nh] = hit_ids
        elif fit > pool.num_free:
            return None
        if nc and cpu is not None:
            cpu.load(r.hashes[nh : nh + nc])
        r.nblocks = r.ncached = nh
        r.computed = computed
        self._take(r, need)
        return nh, nc, chunk

    def remaining(self, r: ReqState) -> int:
        """Blocks r still needs to hold its whole sequence (vLLM's `_request_remaining_blocks`)."""
        return -(-r.target // self.block_size) - r.nblocks

    def grow(self, r: ReqState, upto: int) -> bool:
        """Blocks for r's first `upto` tokens; False (nothing taken) when too few are free."""
        need = -(-upto // self.block_size) - r.nblocks
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        self._take(r, need)
        return True

    def _take(self, r: ReqState, need: int) -> None:
        pool = self.pool
        at = r.nblocks
        if need == 1:  # a decode starting a block: scalar operations
            b, lost = pool.allocate_one()
            r.table[at] = b
            if lost is not None:
                if self.cpu is None:  # (`_evicted` without its block array)
                    if self.sink is not None:
                        self.sink.removed([lost], GPU)
                else:
                    self._evicted(np.array((b,), dtype=np.int64), [lost])
        elif need:
            ids, evicted, ev_hashes = pool.allocate(need)
            r.table[at : at + need] = ids
            if len(evicted):
                self._evicted(evicted, ev_hashes)
        r.nblocks = at + need

    def cache_full(self, r: ReqState, upto: int) -> None:
        """Hash and cache r's blocks that the first `upto` tokens fill; one BlockStored for them."""
        bs = self.block_size
        a, b = r.ncached, upto // bs
        if b <= a:
            return
        r.ncached = b
        sink = self.sink
        if b - a == 1:  # a decode filling a block: scalar operations
            blk: int = r.table.item(a)
            self.pool.cache_at(blk, r.values, a)
            if self.cpu is not None and not self._write_through:  # (write-back: for `_evicted`)
                self._btag[blk] = r.tag
                self._btok[blk] = r.tokens[a * bs : b * bs]
                self._bfirst[blk] = a == 0
                self._bparent[blk] = r.values.item(a - 1) if a else 0
            if sink is not None:
                parent = r.values.item(a - 1) if a else None
                tokens = r.tokens[a * bs : b * bs].tolist()
                sink.stored([r.values.item(a)], parent, tokens, GPU, r.lora, r.salt)
            if self._write_through:
                self._store_cpu(r, a, b)
            return
        ids = r.table[a:b]
        self.pool.cache(ids, r.values[a:b])
        if self.cpu is not None and not self._write_through:
            self._btag[ids] = r.tag
            self._btok[ids] = r.tokens[a * bs : b * bs].reshape(b - a, bs)
            self._bfirst[ids] = False
            if a:
                self._bparent[ids] = r.values[a - 1 : b - 1]
            else:
                self._bfirst[ids[0]] = True
                self._bparent[ids[1:]] = r.values[: b - 1]
        if sink is not None:
            parent = r.values.item(a - 1) if a else None
            sink.stored(
                r.values[a:b].tolist(), parent, r.tokens[a * bs : b * bs].tolist(), GPU, r.lora, r.salt
            )
        if self._write_through:
            self._store_cpu(r, a, b)

    def _store_cpu(self, r: ReqState, a: int, b: int) -> None:
        """Write-through: r's blocks a..b-1, just cached on the GPU, are stored on the CPU tier too (those
        it holds already are refreshed): a `BlockStored` per run of new ones, then the CPU's evictions."""
        cpu = self.cpu
        assert cpu is not None
        sink = self.sink
        bs = self.block_size
        values = r.values
        start = -1
        gone: list[int] = []
        for i in range(a, b + 1):
            new = False
            if i < b:
                new, lost = cpu.put(values.item(i))
                gone += lost
            if new and start < 0:
                start = i
            elif not new and start >= 0:
                if sink is not None:
                    parent = values.item(start - 1) if start else None
                    tokens = r.tokens[start * bs : i * bs].tolist()
                    sink.stored(values[start:i].tolist(), parent, tokens, CPU, r.lora, r.salt)
                start = -1
        if gone and sink is not None:
            sink.removed(gone, CPU)

    def reset_prefix_cache(self, at: float) -> bool:
        """Forget every cached block, on the GPU and the CPU tier, and publish `AllBlocksCleared` (at
        simulated time `at`); refused (False) while a request holds blocks."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.cpu is not None:
            self.cpu.clear()
        if self.sink is not None:
            self.sink.cleared()
            self.sink.flush(at)
        return True

    def free(self, r: ReqState) -> None:
        """Release all of r's blocks, last first."""
        self.pool.free(r.table[: r.nblocks][::-1])
        r.nblocks = r.ncached = 0

    def _evicted(self, ids: Ids, values: npt.NDArray[np.uint64] | list[int]) -> None:
        """GPU blocks `ids` lost their cached content (hashes `values`): report it, and keep it on the
        CPU tier."""
        sink = self.sink
        cpu = self.cpu
        if cpu is None and sink is None:
            return
        hashes: list[int] = values.tolist() if isinstance(values, np.ndarray) else values
        if cpu is None or self._write_through:  # (write-through: the CPU tier has it, or dropped it)
            if sink is not None:
                sink.removed(hashes, GPU)
            return
        for b, h in zip(ids.tolist(), hashes, strict=True):
            new, gone = cpu.put(h)
            if sink is None:
                continue
            if new:
                parent = None if self._bfirst[b] else int(self._bparent[b])
                lora, salt = self._chains[int(self._btag[b])]
                sink.stored([h], parent, self._btok[b].tolist(), CPU, lora, salt)
            if gone:
                sink.removed(gone, CPU)
            sink.removed([h], GPU)
