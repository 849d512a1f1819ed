"""The 1-D persistent grids of the grid-stride kernels (RoPE, the KV write): their size and their launch check.

Such a kernel walks its work items with a grid stride, so any 1-D grid of whole warps covers them; the host
launches one that covers the items once, capped at one resident wave (``num_sms * ctas_per_sm`` CTAs: no CTA
waits for another to finish), and the emulators refuse a launch shape the kernel does not handle.
"""

from __future__ import annotations

__all__ = ["persistent_geometry", "check_1d_launch"]


def _check_threads(kernel: str, threads: int, max_threads: int) -> None:
    if threads <= 0 or threads % 32 or threads > max_threads:
        raise ValueError(f"{kernel}: threads must be a multiple of 32 in [32, {max_threads}], got {threads}")


def persistent_geometry(kernel: str, items: int, items_per_cta: int, threads: int, *, max_threads: int,
                        num_sms: int, ctas_per_sm: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """``(grid, block, 0)`` of a persistent launch of ``kernel``: CTAs of ``threads`` threads covering ``items``
    (at least one) once, ``items_per_cta`` each, at most ``num_sms * ctas_per_sm`` of them.

    Parameters
    ----------
    kernel : str
        The entry, for the error message.
    items : int
        Work items (tokens) of the launch.
    items_per_cta : int
        Items one CTA of ``threads`` takes per grid-stride iteration (used only once ``threads`` passed).
    threads : int
        Threads per CTA: whole warps, at most ``max_threads`` (the kernel's launch bounds).
    max_threads, num_sms, ctas_per_sm : int
        The kernel's largest block, the device's SMs, and the resident CTAs of ``threads`` per SM.

    Raises
    ------
    ValueError
        ``threads`` not a multiple of 32 in ``[32, max_threads]``.
    """
    _check_threads(kernel, threads, max_threads)
    ctas = -(-max(int(items), 1) // items_per_cta)
    return (max(1, min(ctas, num_sms * ctas_per_sm)), 1, 1), (threads, 1, 1), 0


def check_1d_launch(kernel: str, grid, block, max_threads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(grid, block)`` as int tuples, checked to be a 1-D grid and a 1-D block of whole warps, at most
    ``max_threads`` (the shapes a grid-stride kernel handles; an emulator's first check).

    Raises
    ------
    ValueError
        Any other shape, naming ``kernel`` and the shape.
    """
    grid = tuple(int(x) for x in grid)
    block = tuple(int(x) for x in block)
    if len(grid) != 3 or grid[0] < 1 or grid[1:] != (1, 1):
        raise ValueError(f"{kernel} needs a 1-D grid (X >= 1), got {grid}")
    if len(block) != 3 or block[1:] != (1, 1) or block[0] < 32 or block[0] % 32 or block[0] > max_threads:
        raise ValueError(f"{kernel} needs a 1-D block of whole warps (<= {max_threads}), got {block}")
    return grid, block
