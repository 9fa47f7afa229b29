"""A cache prefetch hint for the compiled loops over large tables. Pure.

A probe or insert into a hash table larger than the caches waits ~100 ns for each bucket it reads, and a
loop that takes items one at a time waits for them one after the other. `prefetch(arr, i)` asks the CPU
to start loading `arr[i]`'s cache line now and goes on (LLVM's `llvm.prefetch`: no fault, no effect on
any result), so that a loop can name the buckets of the item a few places ahead while it works on this
one, and the waits overlap. On a table that fits in the caches it costs a few instructions per item.

Compiled with numba (`docs/architecture.md`, "Compiled loops").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

AHEAD: Final = 8
"""How many items ahead the loops prefetch: enough misses in flight to cover the latency, few enough that
the lines are still in L1/L2 when the item comes."""

_I32 = ir.IntType(32)


def _prefetch(typingctx: Any, arr: Any, i: Any) -> Any:
    if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
        return None
    sig = types.void(arr, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)  # (declared once per module)
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        # (read, locality 3 = keep in all levels, data cache)
        builder.call(fn, [address, _I32(0), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return sig, codegen


prefetch = cast(Callable[[Any, int], None], intrinsic(_prefetch))
"""prefetch(arr, i), in compiled code: start loading the cache line of arr[i] (for reading, into every cache
level). `i` must be in bounds."""
