"""q12drv: batched ("Q12") prefill for LLM inference runtimes: the metadata of N prompt streams staged into a
device arena with one copy, and the kernels that read it.

The way in is the pass. Plan once per batch, then run the layers::

    dev = q12drv.open_device()                                  # the GPU, or the emulated driver without one
    arena = q12drv.ScratchArena(dev, nbytes)                    # or ScratchArena over memory the runtime owns
    step = q12drv.Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0)   # admission, layout,
                                                                #   staging: batched, or per stream (step.reason)
    step.attention_layer(q, k, v, k_pool, v_pool, o, shape)      # RoPE, KV write, paged attention
    step.conv1d(conv_states, x, y, w)                           # the short convolution, per-stream states
    step.gdn_layer(ssm_states, q12drv.GdnTensors(...), gshape)  # Gated DeltaNet, per-stream states

Each layer op can also be called alone (:meth:`Q12Pass.rope`, :meth:`Q12Pass.kv_write`, :meth:`Q12Pass.attention`)
with the batched / per-stream decision already made; tensors (torch, CuPy, anything with the CUDA Array Interface
or DLPack) or raw device addresses are accepted wherever memory is. :class:`PassGraph` is a pass captured as a CUDA
graph for fixed maxima and replayed with new metadata. Underneath, the stager
(:func:`stage_batched_attn_metadata`), the sizing functions and admission stay public for runtimes that drive
the launchers (:mod:`q12drv.ops`) themselves.

Layers of the package, bottom up (each imports only from those below it): :mod:`q12drv.core` (driver, device,
memory, compiling and launching, layout, arena, staging, admission), :mod:`q12drv.kernels` (one module per kernel
family, the launchers in :mod:`q12drv.kernels.ops`), :mod:`q12drv.prefill` (the pass and its CUDA graph),
:mod:`q12drv.tools` (dumps, demo, doctor, the ``q12drv`` command).
"""

from ._version import __version__
from .core.admission import Admission, check_kernel_batched_eligible
from .core.arena import ScratchArena
from .core.device import Device, DeviceArray, Stream, open_device
from .core.errors import CapacityError, CudaError, DriverUnavailableError, DumpError, HostRaceError, NvrtcError, Q12Error
from .core.layout import (
    Q12_SIZING_STREAMS,
    ScratchPlan,
    make_scratch_plan,
    q12_batched_scratch_bytes,
    q12_batched_scratch_bytes_varlen,
    staged_bytes,
)
from .core.ptr import NULL, DevicePtr
from .core.staging import (
    BatchedAttnMetadata,
    HStateSlot,
    StateRow,
    StreamStageInfo,
    place_h_state_slot,
    stage_batched_attn_metadata,
    stage_stream_metadata,
)
from .kernels import ops
from .kernels.gdn import GdnConfig, GdnPlan, GdnShape, GdnTensors, plan_gdn
from .kernels.rope import MROPE_CHUNKED, MROPE_INTERLEAVED, MROPE_OFF, RopeScaling
from .prefill import AttentionShape, Q12Pass
from .prefill.graphs import PassGraph, capture


__all__ = [
    "Admission",
    "AttentionShape",
    "BatchedAttnMetadata",
    "CapacityError",
    "CudaError",
    "Device",
    "DeviceArray",
    "DevicePtr",
    "DriverUnavailableError",
    "DumpError",
    "GdnConfig",
    "GdnPlan",
    "GdnShape",
    "GdnTensors",
    "HStateSlot",
    "HostRaceError",
    "MROPE_CHUNKED",
    "MROPE_INTERLEAVED",
    "MROPE_OFF",
    "NULL",
    "NvrtcError",
    "PassGraph",
    "Q12Error",
    "Q12Pass",
    "Q12_SIZING_STREAMS",
    "RopeScaling",
    "ScratchArena",
    "ScratchPlan",
    "StateRow",
    "Stream",
    "StreamStageInfo",
    "capture",
    "check_kernel_batched_eligible",
    "make_scratch_plan",
    "open_device",
    "ops",
    "place_h_state_slot",
    "plan_gdn",
    "q12_batched_scratch_bytes",
    "q12_batched_scratch_bytes_varlen",
    "stage_batched_attn_metadata",
    "stage_stream_metadata",
    "staged_bytes",
]
