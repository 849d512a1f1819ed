"""Gated DeltaNet (Qwen3-Next) prefill over varlen streams: one API over the family of kernels.

Choose with a :class:`GdnConfig` (math, schedule, instruction set; ``GdnConfig()`` is the fastest path on the device),
resolve it for a device and a batch with :func:`plan_gdn` (a frozen :class:`GdnPlan`: the kernels, their geometry,
the workspace they need), launch with :func:`gdn`::

    plan = plan_gdn(GdnConfig(), GdnShape(16, 32, 128), n_streams=8, max_tokens=2048, device=dev)
    ws = dev.alloc(plan.workspace_bytes)
    gdn(dev, meta, h_state_ptrs, GdnTensors(q, k, v, g, beta, o), plan.shape, plan,
        workspace=ws.ptr, workspace_bytes=plan.workspace_bytes)

Modules: :mod:`.plan` (the choices and the rules), :mod:`.launch` (the launcher), :mod:`.recurrent`,
:mod:`.chunked_mma`, :mod:`.chunked_wgmma` (each source's entries, sizes, geometry, emulators), :mod:`.reference`
(the numpy recurrence and the chunked kernels' model). ``cuda_src/gdn/*``'s headers describe the kernels;
``docs/kernels/gdn.md`` what was measured on the way.
"""

from __future__ import annotations

from . import chunked_mma, chunked_wgmma, recurrent, reference
from .launch import GdnTensors, enqueue_gdn, gdn
from .plan import GdnConfig, GdnKernel, GdnPlan, GdnShape, plan_gdn

__all__ = ["GdnShape", "GdnConfig", "GdnTensors", "GdnPlan", "GdnKernel", "plan_gdn", "gdn", "enqueue_gdn",
           "entry_smem", "reference", "recurrent", "chunked_mma", "chunked_wgmma", "SOURCES"]

#: The GDN kernel sources in ``cuda_src/``.
SOURCES = (recurrent.SOURCE, chunked_mma.SOURCE, chunked_wgmma.SOURCE)


def entry_smem(entry: str) -> int:
    """Dynamic shared memory a launch of GDN entry ``entry`` asks for (0 for the recurrent kernel's)."""
    if entry in recurrent.ENTRIES:
        return 0
    if entry in chunked_mma.ENTRIES:
        return chunked_mma.entry_smem(entry)
    return chunked_wgmma.entry_smem(entry)
