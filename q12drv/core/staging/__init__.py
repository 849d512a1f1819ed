"""Staging: the metadata of N prefill streams packed into pinned memory and uploaded with one copy.

One pass's streams flow through each step once: :mod:`.validate` (every input checked, nothing written on bad
input) -> :mod:`.pack` (the fields at the layout's offsets in a pinned ring slot, one copy) -> :mod:`.metadata`
(the :class:`BatchedAttnMetadata` describing what was staged) -> :mod:`.h_state` (the per-SSM-layer
``h_state_ptrs`` slot right after it). :mod:`.stage` runs the steps; :mod:`.reference` rebuilds the same fields
the slow, obvious way, to verify a read-back.
"""

from .h_state import HStateSlot, StateRow, place_h_state_slot, reserve_h_state_slot, stage_state_rows
from .metadata import (
    BatchedAttnMetadata,
    StreamStageInfo,
    host_copies,
    metadata_at,
    metadata_of_pass,
    pass_fields,
    unpack_metadata,
)
from .pack import pack_metadata, pack_padded, pack_tail, staging_ring
from .reference import expected_fields, verify_readback
from .stage import UPLOADS, stage_batched_attn_metadata, stage_replicated, stage_stacked, stage_stream_metadata
from .validate import SEQ_LEN_ALIGN, STATE_ALIGN, TABLE_ALIGN, plain_pointers, plain_table, validate_streams

__all__ = [
    "SEQ_LEN_ALIGN",
    "STATE_ALIGN",
    "TABLE_ALIGN",
    "BatchedAttnMetadata",
    "HStateSlot",
    "StateRow",
    "StreamStageInfo",
    "UPLOADS",
    "expected_fields",
    "host_copies",
    "metadata_at",
    "metadata_of_pass",
    "pack_metadata",
    "pack_padded",
    "pack_tail",
    "pass_fields",
    "place_h_state_slot",
    "plain_pointers",
    "plain_table",
    "reserve_h_state_slot",
    "stage_batched_attn_metadata",
    "stage_replicated",
    "stage_state_rows",
    "stage_stacked",
    "stage_stream_metadata",
    "staging_ring",
    "unpack_metadata",
    "validate_streams",
    "verify_readback",
]
