"""The recurrent GDN kernel (``cuda_src/gdn/recurrent.cu``): token by token in fp32, the GPU reference of the
chunked kernels. Its entries, launch geometry, contract defines and emulators.

A CTA owns :data:`COLS_PER_CTA` dv columns of one (stream, value head); static shared memory only.
"""

from __future__ import annotations

from .. import registry
from . import emulate

__all__ = ["SOURCE", "ENTRIES", "HEAD_DIMS", "THREADS", "LANES_PER_COLUMN", "COLS_PER_THREAD", "COLS_PER_CTA",
           "entry", "geometry", "CONTRACTS", "EMULATORS"]

#: Kernel source file in ``cuda_src/``.
SOURCE = "gdn/recurrent.cu"
#: Head dims ``dk = dv`` with kernels.
HEAD_DIMS = (128, 64)
#: Entry points, by head dim.
ENTRIES = tuple(f"q12_gdn_recurrent_d{d}" for d in HEAD_DIMS)
#: Threads per CTA (``recurrent_config().threads`` in the source).
THREADS = 128
#: Lanes that split dk for one dv column (``recurrent_config().lanes_per_column``).
LANES_PER_COLUMN = 8
#: dv columns one thread owns (``recurrent_config().columns_per_thread``).
COLS_PER_THREAD = 2
#: dv columns one CTA owns.
COLS_PER_CTA = THREADS // LANES_PER_COLUMN * COLS_PER_THREAD


def entry(head_dim: int) -> str:
    """The entry for ``dk = dv = head_dim``.

    Raises
    ------
    ValueError
        A head dim without a kernel (the message lists the ones with).
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the GDN kernels have head_dim 64 and 128, not {head_dim}")
    return f"q12_gdn_recurrent_d{head_dim}"


def geometry(n: int, num_v_heads: int, head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """``(grid, block, dynamic smem)``: grid ``(Hv * dv / COLS_PER_CTA, n, 1)``, :data:`THREADS` threads, none.

    Parameters
    ----------
    n : int
        Streams (``batch_size``).
    num_v_heads : int
        Value heads ``Hv``.
    head_dim : int
        ``dk = dv`` (64 or 128).
    """
    entry(head_dim)
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return (num_v_heads * (head_dim // COLS_PER_CTA), n, 1), (THREADS, 1, 1), 0


def _contracts() -> dict[str, int]:
    """The host's numbers ``gdn/recurrent.cu`` checks at compile time."""
    return {"Q12_GDN_RECURRENT_THREADS": THREADS, "Q12_GDN_RECURRENT_COLUMNS": COLS_PER_CTA}


def _emulator(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the recurrent entry: check that the launch covers what the kernel covers, then the float64
        reference through emulated memory ``mem``."""
        n, _hk, hv = emulate.heads(args)
        want_grid, want_block, _ = geometry(max(n, 1), hv, head_dim)
        if tuple(block) != want_block:
            raise ValueError(f"the recurrent GDN kernel needs block {want_block}, got {tuple(block)}")
        if grid[0] < want_grid[0] or grid[1] < n or grid[2] < 1:
            raise ValueError(f"grid {tuple(grid)} does not cover Hv*dv/{COLS_PER_CTA} = {want_grid[0]} CTAs x "
                             f"n = {n} streams")
        emulate.run_reference(args, mem, head_dim)
    return run


#: What the emulated driver runs instead of each entry point.
EMULATORS = {entry(d): _emulator(d) for d in HEAD_DIMS}

#: The host/device contract: the numbers above, passed as ``-D`` to every build of the source and checked there.
CONTRACTS = _contracts()

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
