"""The recurrent GDN kernels (``cuda_src/gdn/recurrent.cu``): token by token in fp32, the GPU reference of the
chunked kernels. Their entries, launch geometry, contract defines and emulators.

Two builds of the same recurrence: the token-chunked one (a CTA owns :data:`COLS_PER_CTA` dv columns of one (stream,
value head), its state slice in registers while it streams the tokens) and the decode one (a CTA owns
``DECODE_TILES[d][1]`` dv columns and all dk rows in 256 threads, the state read and written once in 16-byte rows:
for a few tokens a stream, where moving the state is the whole cost). Static shared memory only.
"""

from __future__ import annotations

from .. import registry
from . import emulate

__all__ = ["SOURCE", "ENTRIES", "HEAD_DIMS", "THREADS", "LANES_PER_COLUMN", "COLS_PER_THREAD", "COLS_PER_CTA",
           "DECODE_ENTRIES", "DECODE_TILES", "entry", "geometry", "decode_entry",
           "decode_geometry", "CONTRACTS", "EMULATORS"]

#: Kernel source file in ``cuda_src/``.
SOURCE = "gdn/recurrent.cu"
#: Head dims ``dk = dv`` with kernels.
HEAD_DIMS = (128, 64)
#: The decode build's entry points, by head dim.
DECODE_ENTRIES = tuple(f"q12_gdn_recurrent_decode_d{d}" for d in HEAD_DIMS)
#: Entry points, by head dim: the token-chunked build's, then the decode build's.
ENTRIES = tuple(f"q12_gdn_recurrent_d{d}" for d in HEAD_DIMS) + DECODE_ENTRIES
#: Threads per CTA (``recurrent_config().threads`` in the source).
THREADS = 128
#: Lanes that split dk for one dv column (``recurrent_config().lanes_per_column``).
LANES_PER_COLUMN = 8
#: dv columns one thread owns (``recurrent_config().columns_per_thread``).
COLS_PER_THREAD = 2
#: dv columns one CTA owns.
COLS_PER_CTA = THREADS // LANES_PER_COLUMN * COLS_PER_THREAD
#: The decode build's tiles by head dim: (threads per CTA, dv columns a CTA owns), ``decode_config(d)``'s.
DECODE_TILES = {128: (256, 64), 64: (256, 32)}


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


def decode_entry(head_dim: int) -> str:
    """The decode build's entry for ``dk = dv = head_dim`` (ValueError as :func:`entry`)."""
    entry(head_dim)
    return f"q12_gdn_recurrent_decode_d{head_dim}"


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
    return _grid(n, num_v_heads, head_dim, COLS_PER_CTA), (THREADS, 1, 1), 0


def decode_geometry(n: int, num_v_heads: int, head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int],
                                                                       int]:
    """The decode build's ``(grid, block, dynamic smem)``: grid ``(Hv * dv / columns, n, 1)`` and ``threads`` a CTA
    from :data:`DECODE_TILES`, none (parameters as :func:`geometry`)."""
    entry(head_dim)
    threads, columns = DECODE_TILES[head_dim]
    return _grid(n, num_v_heads, head_dim, columns), (threads, 1, 1), 0


def _grid(n: int, num_v_heads: int, head_dim: int, columns: int) -> tuple[int, int, int]:
    entry(head_dim)
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return num_v_heads * (head_dim // columns), n, 1


def _contracts() -> dict[str, int]:
    """The host's numbers ``gdn/recurrent.cu`` checks at compile time."""
    return {"Q12_GDN_RECURRENT_THREADS": THREADS, "Q12_GDN_RECURRENT_COLUMNS": COLS_PER_CTA,
            **{f"Q12_GDN_DECODE_D{d}_{k}": v for d, (t, c) in DECODE_TILES.items()
               for k, v in (("THREADS", t), ("COLUMNS", c))}}


def _emulator(head_dim: int, geometry_of, columns: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate a recurrent entry: check that the launch covers what the kernel covers, then the float64
        reference through emulated memory ``mem``."""
        n, _hk, hv = emulate.heads(args)
        want_grid, want_block, _ = geometry_of(max(n, 1), hv, head_dim)
        if tuple(block) != want_block:
            raise ValueError(f"the recurrent GDN kernel needs block {want_block}, got {tuple(block)}")
        if grid[0] < want_grid[0] or grid[1] < n or grid[2] < 1:
            raise ValueError(f"grid {tuple(grid)} does not cover Hv*dv/{columns} = {want_grid[0]} CTAs x "
                             f"n = {n} streams")
        emulate.run_reference(args, mem, head_dim)
    return run


#: What the emulated driver runs instead of each entry point.
EMULATORS = {**{entry(d): _emulator(d, geometry, COLS_PER_CTA) for d in HEAD_DIMS},
             **{decode_entry(d): _emulator(d, decode_geometry, DECODE_TILES[d][1]) for d in HEAD_DIMS}}

#: The host/device contract: the numbers above, passed as ``-D`` to every build of the source and checked there.
CONTRACTS = _contracts()

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
