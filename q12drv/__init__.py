"""q12drv: stage batched ("Q12") prefill metadata into a raw CUDA arena, and the kernels that read it.

Layers, bottom up (each imports only from those below it): errors and :class:`DevicePtr`;
:mod:`~q12drv.core.driver` (real or emulated CUDA driver); :mod:`~q12drv.core.device`; :mod:`~q12drv.core.nvrtc`
and :mod:`~q12drv.core.launch`; :mod:`~q12drv.core.layout` (every byte offset); :mod:`~q12drv.core.arena`;
:mod:`~q12drv.core.staging`; :mod:`~q12drv.core.admission`; :mod:`~q12drv.kernels`; :mod:`~q12drv.prefill`;
:mod:`~q12drv.tools.dump` (with :mod:`~q12drv.tools.inspect`, :mod:`~q12drv.tools.diff`, :mod:`~q12drv.tools.render`); :mod:`~q12drv.tools.cli`.
"""

from .core.admission import Admission, check_kernel_batched_eligible
from .core.arena import ScratchArena
from .core.device import Device, DeviceArray, open_device
from .core.errors import CapacityError, CudaError, DriverUnavailableError, DumpError, HostRaceError, NvrtcError, Q12Error
from .core.layout import (
    Q12_SIZING_STREAMS,
    ScratchPlan,
    make_scratch_plan,
    q12_batched_scratch_bytes,
    q12_batched_scratch_bytes_varlen,
)
from .core.ptr import NULL, DevicePtr
from .core.staging import (
    BatchedAttnMetadata,
    HStateSlot,
    StreamStageInfo,
    place_h_state_slot,
    stage_batched_attn_metadata,
    stage_stream_metadata,
)

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "BatchedAttnMetadata",
    "CapacityError",
    "CudaError",
    "Device",
    "DeviceArray",
    "DevicePtr",
    "DriverUnavailableError",
    "DumpError",
    "HStateSlot",
    "HostRaceError",
    "NULL",
    "NvrtcError",
    "Q12Error",
    "Q12_SIZING_STREAMS",
    "ScratchArena",
    "ScratchPlan",
    "StreamStageInfo",
    "check_kernel_batched_eligible",
    "make_scratch_plan",
    "open_device",
    "place_h_state_slot",
    "q12_batched_scratch_bytes",
    "q12_batched_scratch_bytes_varlen",
    "stage_batched_attn_metadata",
    "stage_stream_metadata",
]
