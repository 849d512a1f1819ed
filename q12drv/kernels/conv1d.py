"""The short convolution (``cuda_src/conv1d.cu``): causal depthwise conv1d with SiLU over a pass's packed streams,
each stream's state updated in place. The host side: geometry, the numpy reference, the emulator, the launcher.

Qwen3-Next's Gated DeltaNet layer runs it over ``[q | k | v]`` (``C = 2 Hk dk + Hv dv`` channels, width 4)
before the delta rule. Layouts (bf16 throughout):

* ``x``, ``y``: ``[T, C]`` rows of the packed tokens, ``x_stride`` / ``y_stride`` elements apart (a strided slice
  of a wider projection is fine: the strides say where each row starts); x and y must not overlap;
* ``w``: ``[C, W]`` (PyTorch's depthwise ``Conv1d.weight[:, 0, :]``), 16-byte aligned; ``bias``: ``[C]`` or none;
* stream b's state at ``state_ptrs[b]``: ``[W - 1, C]`` bf16, rows ``state_stride`` elements apart, the last row
  the newest input; read before the pass, overwritten with the last ``W - 1`` inputs after it (a new prompt's
  state is zeros).

Entries::

    q12_conv1d_w{2,3,4}(Q12Meta m, const bf16* x, bf16* y, const bf16* w, const bf16* bias,
                        const u64* state_ptrs, int channels, int x_stride, int y_stride, int state_stride,
                        int silu)

grid ``(ceil(C / 8 / THREADS), ceil(chunk_len / SEGMENT), n)``, block ``(THREADS, 1, 1)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.bf16 import from_bf16_bits, to_bf16_bits
from ..core.device import Device
from ..core.layout import rows_extent
from ..core.staging import BatchedAttnMetadata
from . import args as _args
from . import registry
from .layer_launch import LayerLaunch, for_metadata
from .meta import Q12MetaC, meta_struct

__all__ = ["SOURCE", "ENTRIES", "WIDTHS", "THREADS", "SEGMENT", "CONTRACTS", "geometry", "reference", "emulate_conv1d",
           "EMULATORS", "conv1d", "check_conv1d", "enqueue_conv1d", "conv1d_launch", "entry_for_width", "POINTERS"]

SOURCE = "conv1d.cu"
#: Kernel widths there is an entry for.
WIDTHS = (2, 3, 4)
ENTRIES = tuple(f"q12_conv1d_w{w}" for w in WIDTHS)
#: Threads per CTA (``conv1d_config().threads`` in the source).
THREADS = 128
#: Tokens one thread walks (``kSegment``).
SEGMENT = 64
#: Channels one thread owns (one 16-byte vector of bf16).
VEC = 8
#: The host/device contract: the launch numbers :func:`geometry` uses, passed as ``-D`` to every build of
#: ``conv1d.cu`` and checked there against ``conv1d_config()``.
CONTRACTS = {"Q12_CONV1D_THREADS": THREADS, "Q12_CONV1D_SEGMENT": SEGMENT, "Q12_CONV1D_VEC": VEC}
#: Byte alignment each pointer needs (:data:`~q12drv.kernels.args.ALIGN`'s entry).
ALIGN = _args.ALIGN["conv1d"]
_BF16 = 2


def entry_for_width(width: int) -> str:
    """The entry of kernel width ``width``; ValueError for a width without one."""
    if width not in WIDTHS:
        raise ValueError(f"the short convolution has kernels for widths {WIDTHS}, not {width}")
    return f"q12_conv1d_w{width}"


def geometry(n: int, chunk_len: int, channels: int) -> tuple:
    """``(grid, block, smem)`` for ``n`` streams of at most ``chunk_len`` tokens and ``channels`` channels."""
    gx = -(-channels // (VEC * THREADS))
    gy = max(1, -(-chunk_len // SEGMENT))
    return (gx, gy, n), (THREADS, 1, 1), 0


def reference(x: np.ndarray, w: np.ndarray, states: list, cu_seqlens, *, bias: np.ndarray | None = None,
              silu: bool = True) -> tuple:
    """The convolution in float64 from the values given (no rounding but the caller's).

    Parameters
    ----------
    x : numpy.ndarray
        ``[T, C]`` inputs (floats).
    w : numpy.ndarray
        ``[C, W]`` taps.
    states : list of numpy.ndarray
        Per stream ``[W - 1, C]``, the last row the newest input.
    cu_seqlens : sequence of int
        ``n + 1`` prefix sums of the streams' token counts.
    bias : numpy.ndarray, optional
        ``[C]``.
    silu : bool
        Apply SiLU.

    Returns
    -------
    tuple
        ``(y [T, C] float64, new states: list of [W - 1, C] float64)``.
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    width = w.shape[1]
    y = np.zeros_like(x)
    new_states = []
    for b in range(len(cu_seqlens) - 1):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        seq = np.concatenate([np.asarray(states[b], np.float64), x[lo:hi]], axis=0)  # W - 1 + L rows
        for t in range(hi - lo):
            window = seq[t:t + width]  # inputs t - (W - 1) .. t
            acc = np.einsum("jc,cj->c", window, w)
            if bias is not None:
                acc = acc + np.asarray(bias, np.float64)
            y[lo + t] = acc / (1.0 + np.exp(-acc)) if silu else acc
        new_states.append(seq[len(seq) - (width - 1):].copy())
    return y, new_states


def _emulator(width: int):
    def emulate(args: dict, mem, grid, block) -> None:
        """Emulated-driver stand-in for ``q12_conv1d_w{width}``: the kernel's arithmetic (fp32 accumulation in the
        taps' order, one rounding) on the emulated memory."""
        m: Q12MetaC = args["m"]
        n, c = int(m.batch_size), int(args["channels"])
        sx, sy, ss = int(args["x_stride"]), int(args["y_stride"]), int(args["state_stride"])
        if n == 0 or c == 0:
            return
        cu = np.array(mem.array(m.cu_seqlens, np.int32, (n + 1,)), np.int64)
        t_total = int(cu[-1])
        w = from_bf16_bits(np.array(mem.array(args["w"], np.uint16, (c, width))))
        bias = (from_bf16_bits(np.array(mem.array(args["bias"], np.uint16, (c,)))) if args["bias"]
                else np.zeros(c, np.float32))
        ptrs = np.array(mem.array(args["state_ptrs"], np.uint64, (n,)))
        rows_x = max(t_total - 1, 0) * sx + c
        x_all = mem.array(args["x"], np.uint16, (rows_x,)) if t_total else None
        y_all = mem.array(args["y"], np.uint16, (max(t_total - 1, 0) * sy + c,)) if t_total else None
        for b in range(n):
            lo, hi = int(cu[b]), int(cu[b + 1])
            if hi <= lo:
                continue
            st = mem.array(int(ptrs[b]), np.uint16, ((width - 2) * ss + c,))
            state = np.stack([st[r * ss:r * ss + c] for r in range(width - 1)])
            xb = np.stack([x_all[t * sx:t * sx + c] for t in range(lo, hi)])
            seq = from_bf16_bits(np.concatenate([state, xb]))  # [W - 1 + L, C] fp32
            acc = np.broadcast_to(bias, (hi - lo, c)).astype(np.float32)
            for j in range(width):  # the kernel's order: taps 0 .. W - 1, each one fma
                acc = (w[:, j][None, :] * seq[j:j + hi - lo] + acc).astype(np.float32)
            out = acc / (np.float32(1) + np.exp(-acc)) if args["silu"] else acc
            bits = to_bf16_bits(out)
            for i, t in enumerate(range(lo, hi)):
                y_all[t * sy:t * sy + c] = bits[i]
            last = np.concatenate([state, xb])[-(width - 1):]
            for r in range(width - 1):
                st[r * ss:r * ss + c] = last[r]

    return emulate


EMULATORS = {entry_for_width(w): _emulator(w) for w in WIDTHS}


def conv1d(device: Device, meta: BatchedAttnMetadata, state_ptrs: int, x: int, y: int, w: int, *, channels: int,
           width: int = 4, bias: int | None = None, x_stride: int | None = None, y_stride: int | None = None,
           state_stride: int | None = None, silu: bool = True, stream: Any = None) -> None:
    """Causal depthwise conv1d (+ SiLU) over the packed streams of ``meta``, each stream's state updated in place.

    Parameters
    ----------
    device : Device
    meta : BatchedAttnMetadata
        The pass's metadata (its ``cu_seqlens`` say which rows are whose).
    state_ptrs : int
        Device address of ``n`` u64: stream b's state ``[W - 1, C]`` bf16 (16-byte aligned).
    x, y : int
        Inputs and outputs ``[T, C]`` bf16, 16-byte aligned, not overlapping.
    w : int
        Taps ``[C, W]`` bf16, 16-byte aligned (a thread reads its 8 channels' taps as 16-byte vectors).
    channels : int
        C, a multiple of 8.
    width : int
        W, 2..4 (Qwen3-Next: 4).
    bias : int, optional
        ``[C]`` bf16.
    x_stride, y_stride, state_stride : int, optional
        Row strides in elements (multiples of 8); default ``channels``.
    silu : bool
        Apply SiLU (Qwen3-Next does).
    stream : optional
        The CUDA stream (see ``Device.as_stream``).

    Raises
    ------
    TypeError, ValueError
        A bad pointer, stride, width or channel count, or x and y overlapping: raised before anything is enqueued.
    """
    _args.check_launch(device, meta)
    bf16 = lambda name, value: device.pointer(value, name, dtype="bf16", align=ALIGN[name])  # noqa: E731
    x, y = bf16("x", x), bf16("y", y)
    entry, strides, bias_addr = check_conv1d(meta.total_tokens, x, y, channels=channels, width=width,
                                             bias=None if bias is None else bf16("bias", bias), x_stride=x_stride,
                                             y_stride=y_stride, state_stride=state_stride, silu=silu)
    enqueue_conv1d(device, meta, entry,
                   device.pointer(state_ptrs, "state_ptrs", dtype="u64", align=ALIGN["state_ptrs"]), x, y,
                   bf16("w", w), bias_addr, int(channels), *strides, silu, stream)


def check_conv1d(total_tokens: int, x: int, y: int, *, channels: int, width: int, bias: int | None,
                 x_stride: int | None, y_stride: int | None, state_stride: int | None, silu: bool) -> tuple:
    """:func:`conv1d`'s checks of everything but the device, the state table and ``w``, for ``total_tokens`` rows of
    ``x`` and ``y`` (the whole batch's, however it is launched); ``x``, ``y`` and ``bias`` are addresses the caller
    checked (:meth:`Device.pointer`). Returns ``(entry, (x_stride, y_stride, state_stride), bias address or 0)``.

    Raises
    ------
    TypeError, ValueError
        As :func:`conv1d`.
    """
    c = _args.count("channels", channels)
    if c % VEC:
        raise ValueError(f"channels must be a multiple of {VEC} (16-byte rows), got {c}")
    entry = entry_for_width(width)
    strides = []
    for name, s in (("x_stride", x_stride), ("y_stride", y_stride), ("state_stride", state_stride)):
        s = c if s is None else _args.count(name, s)
        if s < c or s % VEC:
            raise ValueError(f"{name} must be >= channels ({c}) and a multiple of {VEC}, got {s}")
        strides.append(s)
    if not isinstance(silu, bool):
        raise TypeError(f"silu must be a bool, got {type(silu).__name__} {silu!r}")
    xp, yp, t = int(x), int(y), int(total_tokens)
    x_end, y_end = xp + rows_extent(t, c, strides[0], _BF16), yp + rows_extent(t, c, strides[1], _BF16)
    if t and xp < y_end and yp < x_end:
        raise ValueError(f"x [{xp:#x}, {x_end:#x}) and y [{yp:#x}, {y_end:#x}) overlap: a later token would read "
                         f"an output; give y its own buffer")
    return entry, tuple(strides), 0 if bias is None else int(bias)


def enqueue_conv1d(device: Device, meta: BatchedAttnMetadata, entry: str, state_ptrs: int, x: int, y: int, w: int,
                   bias: int, channels: int, x_stride: int, y_stride: int, state_stride: int, silu: bool,
                   stream: Any) -> None:
    """:func:`conv1d` with every argument checked: geometry, pack, launch."""
    args = (entry, channels, x_stride, y_stride, state_stride, silu)
    launch = for_metadata(meta, (device, *args), lambda: conv1d_launch(device, meta, *args))
    launch.launch(device.as_stream(stream), (x, y, w, bias, state_ptrs))


def conv1d_launch(device: Device, meta: BatchedAttnMetadata, entry: str, channels: int, x_stride: int, y_stride: int,
                  state_stride: int, silu: bool) -> LayerLaunch:
    """:func:`enqueue_conv1d` for every layer of a pass: its launch with all but ``(x, y, w, bias, state_ptrs)``
    fixed (checked values, as there; ``bias`` 0 for none); call it with those."""
    grid, block, smem = geometry(meta.batch_size, meta.chunk_len, channels)
    return LayerLaunch(device, entry, grid, block, smem, POINTERS, m=meta_struct(meta), channels=channels,
                       x_stride=x_stride, y_stride=y_stride, state_stride=state_stride, silu=int(silu))


#: The short convolution's per-layer pointer parameters, in their order.
POINTERS = ("x", "y", "w", "bias", "state_ptrs")

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
