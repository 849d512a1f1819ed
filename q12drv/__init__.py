"""q12drv: stage batched ("Q12") prefill metadata into a raw CUDA arena, and the kernels that read it.

Layers, bottom up (each imports only from those below it): errors and :class:`DevicePtr`;
:mod:`~q12drv.driver` (real or emulated CUDA driver); :mod:`~q12drv.device`; :mod:`~q12drv.nvrtc`
and :mod:`~q12drv.launch`; :mod:`~q12drv.layout` (every byte offset); :mod:`~q12drv.arena`;
:mod:`~q12drv.staging`; :mod:`~q12drv.admission`; :mod:`~q12drv.kernels`; :mod:`~q12drv.prefill`;
:mod:`~q12drv.dump` (with :mod:`~q12drv.inspect`, :mod:`~q12drv.diff`, :mod:`~q12drv.render`); :mod:`~q12drv.cli`.
"""

from .admission import Admission, check_kernel_batched_eligible
from .arena import ScratchArena
from .device import Device, DeviceArray, open_device
from .errors import CapacityError, CudaError, DriverUnavailableError, DumpError, HostRaceError, NvrtcError, Q12Error
from .layout import (
    Q12_SIZING_STREAMS,
    ScratchPlan,
    make_scratch_plan,
    q12_batched_scratch_bytes,
    q12_batched_scratch_bytes_varlen,
)
from .ptr import NULL, DevicePtr
from .staging import (
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
