"""Launching a GDN layer: the tensors it reads and writes (:class:`GdnTensors`), the checked launcher
(:func:`gdn`) and the launch of already checked arguments (:func:`enqueue_gdn`, what :class:`~q12drv.prefill.Q12Pass`
calls per batch or per stream)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.device import CURRENT, Device
from ...core.staging import BatchedAttnMetadata
from ..args import ALIGN, check_launch, workspace_ptr
from ..layer_launch import LayerLaunch, for_metadata
from ..meta import meta_struct
from .plan import GdnConfig, GdnPlan, GdnShape, check_shape, plan_gdn

__all__ = ["GdnTensors", "gdn", "enqueue_gdn", "GdnLaunch", "check_workspace", "resolve_plan"]

_ALIGN = ALIGN["gdn"]


@dataclass(frozen=True)
class GdnTensors:
    """Device pointers to a GDN layer's packed rows: q, k ``[T, Hk, d]`` bf16 (16-byte aligned), v ``[T, Hv, d]``
    bf16 (8), g, beta ``[T, Hv]`` fp32 (4; g the log-space gate, beta sigmoided), o ``[T, Hv, d]`` bf16 (8,
    written). Stream b's rows start at ``cu_seqlens[b]``."""

    q: int
    k: int
    v: int
    g: int
    beta: int
    o: int

    def checked(self, device, total_tokens: int, shape: GdnShape) -> tuple[int, int, int, int, int, int]:
        """``(q, k, v, g, beta, o)`` as ints: each a non-NULL device pointer aligned as the kernels need, or a tensor
        whose dtype and shape (``total_tokens`` rows of ``shape``) are checked against the layer's
        (:meth:`Device.pointer <q12drv.core.device.Device.pointer>`). TypeError/ValueError naming the argument."""
        names = ("q", "k", "v", "g", "beta", "o")
        t, hk, hv, d = total_tokens, shape.num_k_heads, shape.num_v_heads, shape.head_dim
        spec = {"q": ("bf16", (t, hk, d)), "k": ("bf16", (t, hk, d)), "v": ("bf16", (t, hv, d)), "g": ("f32", (t, hv)),
                "beta": ("f32", (t, hv)), "o": ("bf16", (t, hv, d))}
        return tuple(device.pointer(getattr(self, n), n, dtype=spec[n][0], shape=spec[n][1], align=_ALIGN[n])
                     for n in names)


def resolve_plan(plan_or_config, shape: GdnShape, n_streams: int, max_tokens: int, device) -> GdnPlan:
    """``plan_or_config`` as a plan for ``n_streams`` streams of at most ``max_tokens`` tokens of ``shape`` on
    ``device``: a :class:`GdnConfig` is planned (:func:`~.plan.plan_gdn`); a :class:`GdnPlan` is checked to cover them."""
    if isinstance(plan_or_config, GdnConfig):
        return plan_gdn(plan_or_config, shape, n_streams, max_tokens, device)
    if not isinstance(plan_or_config, GdnPlan):
        raise TypeError(f"expected a GdnConfig or a GdnPlan, got {type(plan_or_config).__name__}")
    check_shape(shape)
    plan_or_config.check_covers(shape, n_streams, max_tokens, device.arch)
    return plan_or_config


def check_workspace(plan: GdnPlan, need: int, workspace, workspace_bytes, device: Device | None = None) -> int:
    """The checked workspace pointer for a launch of ``plan`` that needs ``need`` bytes (0 when it needs none):
    a device address with ``workspace_bytes``, or (given ``device``) a tensor (its size the default).

    Raises
    ------
    TypeError, ValueError
        A plan that needs a workspace without one (the message names the bytes, and ``schedule="fused"`` as the
        way to run without one), a NULL or misaligned workspace, or one smaller than ``need``.
    """
    return workspace_ptr(need, workspace, workspace_bytes, f"the GDN plan (schedule {plan.schedule!r} on {plan.isa})",
                         "GdnPlan.workspace_bytes_for", "GdnConfig(schedule='fused') runs without one",
                         device=device)


def gdn(device: Device, meta: BatchedAttnMetadata, h_state_ptrs: int, tensors: GdnTensors, shape: GdnShape,
        plan_or_config: GdnConfig | GdnPlan = GdnConfig(), *, workspace: int | None = None,
        workspace_bytes: int | None = None, stream: Any = None) -> GdnPlan:
    """Gated DeltaNet over the packed streams of ``meta``; stream b's fp32 state ``[Hv, d, d]`` at
    ``h_state_ptrs[b]`` is updated in place.

    Parameters
    ----------
    device : Device
    meta : BatchedAttnMetadata
        The staged pass (its ``cu_seqlens``; ``batch_size`` streams of at most ``chunk_len`` tokens).
    h_state_ptrs : int
        Device pointer (8-byte aligned) to ``batch_size`` state pointers (each 4-byte aligned).
    tensors : GdnTensors
    shape : GdnShape
    plan_or_config : GdnConfig or GdnPlan
        What to run: a config is planned for this launch (:func:`~.plan.plan_gdn`; default: the fastest path on this
        device, which needs a workspace); a plan (made for at least this launch's streams and tokens) is run as is.
    workspace, workspace_bytes : int, optional
        Device memory (16-byte aligned) for the plan's two-pass or overlapped schedule and its size, at least
        :meth:`GdnPlan.workspace_bytes_for` this launch; ignored by the fused and recurrent kernels.
    stream : optional

    Returns
    -------
    GdnPlan
        The plan launched.

    Raises
    ------
    TypeError, ValueError
        A bad argument, before anything is enqueued.
    Q12Error
        ``meta`` is stale (its arena was reset since it was staged) or its arena is closed.
    """
    check_launch(device, meta)
    if not isinstance(tensors, GdnTensors):
        raise TypeError(f"tensors must be a GdnTensors, got {type(tensors).__name__}")
    plan = resolve_plan(plan_or_config, shape, meta.batch_size, meta.chunk_len, device)
    ptrs = tensors.checked(device, int(meta.total_tokens), plan.shape)
    states = device.pointer(h_state_ptrs, "h_state_ptrs", dtype="u64", align=_ALIGN["h_state_ptrs"])
    ws = check_workspace(plan, plan.workspace_bytes_for(meta.batch_size, meta.chunk_len), workspace, workspace_bytes)
    enqueue_gdn(device, meta, plan, states, *ptrs, ws, stream)
    return plan


def enqueue_gdn(device: Device, meta: BatchedAttnMetadata, plan: GdnPlan, h_state_ptrs: int, q: int, k: int, v: int,
                g: int, beta: int, o: int, workspace: int, stream: Any) -> None:
    """:func:`gdn` with every argument already checked (ints; ``plan`` covering ``meta``; ``workspace`` from
    :func:`check_workspace`): the launches of ``plan`` for ``meta``'s streams (a :class:`GdnLaunch`, kept for
    ``meta``)."""
    launch = for_metadata(meta, (device, id(plan), workspace), lambda: GdnLaunch(device, meta, plan, workspace),
                          keep=plan)
    launch.launch(device.as_stream(stream), (h_state_ptrs, q, k, v, g, beta, o))


class GdnLaunch:
    """:func:`enqueue_gdn` for every layer of a pass: ``plan``'s launches for ``meta`` with all but the layer's
    pointers fixed (the checked ``workspace``): :meth:`launch` zeroes the workspace range the plan needs zeroed and
    launches its kernels."""

    __slots__ = ("device", "zero", "kernels")

    def __init__(self, device: Device, meta: BatchedAttnMetadata, plan: GdnPlan, workspace: int):
        zero, kernels = plan.launches(meta.batch_size, meta.chunk_len)
        self.device = device
        self.zero = None if zero is None else (int(workspace) + zero[0], int(zero[1]))
        fixed = dict(m=meta_struct(meta), num_k_heads=plan.shape.num_k_heads, num_v_heads=plan.shape.num_v_heads,
                     workspace=workspace)
        self.kernels = tuple(LayerLaunch(device, kern.entry, kern.grid, kern.block, kern.smem, _POINTERS,
                                         dependent=kern.dependent, **fixed) for kern in kernels)

    def launch(self, stream: Any, pointers: tuple) -> None:
        """Launch on the driver stream ``stream`` (as :meth:`LayerLaunch.launch
        <q12drv.kernels.layer_launch.LayerLaunch.launch>` takes it) with ``pointers``: the layer's ``(h_state_ptrs, q,
        k, v, g, beta, o)`` (checked ints; ``h_state_ptrs`` the device address of its state-pointer table)."""
        if self.zero is not None:
            dev = self.device
            if CURRENT.device is not dev:
                dev.set_current()
            dev.driver.memset_d8_async(self.zero[0], 0, self.zero[1], stream)
        for kernel in self.kernels:
            kernel.launch(stream, pointers)


#: The GDN kernels' per-layer pointer parameters, in their order.
_POINTERS = ("h_state_ptrs", "q", "k", "v", "g", "beta", "o")

