"""A software prefetch for the numba kernels' generated code (cpu_decode_attention.py,
cpu_gemv.py, cpu_int8_linear.py, cpu_panel_linear.py): LLVM's llvm.prefetch on one address, a hint that never
faults, even past the end of an array. Imported only where numba (and so llvmlite) is."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE_BYTES = 64  # what one prefetch brings in, on every CPU numba targets here


def emit_prefetch(builder: ir.IRBuilder, pointer: ir.Value, locality: int = 3) -> None:
    """Asks the CPU to bring the cache line at `pointer` into its caches, for a read: into all
    levels (locality 3: x86's prefetcht0), or all but the first (2: prefetcht1)."""
    address = builder.bitcast(pointer, ir.IntType(8).as_pointer())
    i32 = ir.IntType(32)
    suffix = "p0" if getattr(address.type, "is_opaque", False) else "p0i8"
    function = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]),
        f"llvm.prefetch.{suffix}",
    )
    read, data_cache = ir.Constant(i32, 0), ir.Constant(i32, 1)
    builder.call(function, [address, read, ir.Constant(i32, locality), data_cache])


@intrinsic
def prefetch_element(typingctx, array, index):
    """From numba code: asks the CPU to bring the cache line holding array.flat[index] (a
    C-contiguous array) into its caches. Any index is safe: a prefetch never faults."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        emit_prefetch(builder, builder.gep(data, [args[1]]))
        return context.get_dummy_value()

    return types.void(array, index), codegen
