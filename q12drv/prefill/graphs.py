"""CUDA graphs: capture the work of a stream once and replay it; a prefill pass captured for fixed maxima.

* :func:`capture` (a ``with`` block) turns what is enqueued on a stream into a :class:`Graph`.
* :class:`PassGraph` is a Q12 pass for at most ``max_streams`` streams and ``max_tokens`` tokens,
  captured once as [the metadata copy (plus the expansion kernel in ``expand="device"`` mode), the
  layer kernels] and replayed for each new batch. The metadata always lives at the same arena
  addresses and the kernels take it by value, so the captured launches stay valid; before a replay
  :meth:`PassGraph.set_streams` packs the new batch into the pass's own pinned buffer, which the
  captured copy re-reads at every replay (a captured host-to-device copy reads its host buffer when
  the graph runs, not when it was captured). Fewer streams or tokens than the maxima are padding:
  tokens past the real ones have position 0 and slot -1 (the KV write skips them), absent streams
  have no tokens and ``kv_len`` 0, and their ``h_state_ptrs`` entry points at a dummy state. Every SSM layer's
  state-pointer table lives in the arena too (layer 0's at the ``h_state_ptrs`` slot, the others after it),
  uploaded from one pinned buffer with one captured copy beside the metadata's.

Rules a graph imposes (checked where they can be): nothing in the body may allocate, synchronize
or read back; the launch geometry is fixed at capture (q12drv's kernels size their grids from the
maxima and exit early past a stream's tokens); the host must not rewrite the pinned buffers while
a replay may still read them (:class:`PassGraph` waits for the previous replay's event first).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from ..core.arena import ScratchArena
from ..core.device import Device, PinnedBuffer
from ..core.errors import CapacityError, Q12Error
from ..kernels import ops
from ..kernels.conv1d import conv1d as _conv1d
from ..kernels.expand import MAX_STREAMS as _EXPAND_MAX_STREAMS, enqueue_expand
from ..core.layout import stacked_layout, state_tables_bytes
from ..kernels.gdn import GdnConfig, GdnPlan, GdnTensors, gdn, plan_gdn
from .q12pass import AttentionShape, GdnShape, check_attention_pools
from ..core.staging import (BatchedAttnMetadata, StreamStageInfo, validate_streams, metadata_at, pack_padded,
                            plain_table)

__all__ = ["Graph", "capture", "PassGraph", "EXPAND_MODES"]

EXPAND_MODES = ("host", "device")


class Graph:
    """An instantiated CUDA graph on one device. :meth:`launch` enqueues it; :meth:`destroy` frees it."""

    def __init__(self, device: Device):
        self.device = device
        self._graph = None
        self._exec = None

    @property
    def ready(self) -> bool:
        return self._exec is not None

    def launch(self, stream: Any = None) -> None:
        """Enqueue the whole graph on ``stream`` (one driver call)."""
        if self._exec is None:
            raise Q12Error("this graph was not captured (or was destroyed)")
        self.device.driver.graph_launch(self._exec, self.device.as_stream(stream))

    def destroy(self) -> None:
        graph, exec_, self._graph, self._exec = self._graph, self._exec, None, None
        if (graph is not None or exec_ is not None) and not self.device.closed:
            self.device._forget(self)
            self.device.driver.graph_destroy(graph, exec_)


@contextlib.contextmanager
def capture(device: Device, stream: Any = None):
    """Capture what the block enqueues on ``stream`` into a :class:`Graph` (instantiated on exit).

    Examples
    --------
    >>> with capture(dev) as graph:            # doctest: +SKIP
    ...     launch.launch(grid, block)
    >>> graph.launch()                         # doctest: +SKIP

    The work is recorded, not run. If the block raises, capture ends and nothing is kept.
    """
    device._require_open()
    raw = device.as_stream(stream)
    driver = device.driver
    graph = Graph(device)
    driver.begin_capture(raw)
    try:
        yield graph
    except BaseException:
        try:
            driver.graph_destroy(driver.end_capture(raw), None)
        except Exception:
            pass  # the block's error is the one to report
        raise
    g = driver.end_capture(raw)
    try:
        graph._exec = driver.graph_instantiate(g)
    except BaseException:
        driver.graph_destroy(g, None)
        raise
    graph._graph = g
    device._own(graph)


class PassGraph:
    """A prefill pass for fixed maxima, captured once and replayed with new metadata (see the module docstring).

    Parameters
    ----------
    arena : ScratchArena
        Reset and laid out by the pass: the stacked block for the maxima at offset 0, the
        ``h_state_ptrs`` slot right after it (offset + ``staged_bytes``), followed by the other SSM layers' tables
        (:func:`~q12drv.core.layout.state_tables_bytes` of ``num_ssm_layers`` tables in all).
    max_streams, max_tokens : int
        The maxima the pass is sized for (stacked layout ``(max_streams, max_tokens)``).
    max_chunk : int, optional
        Longest stream the pass accepts (sizes the attention grid); default ``max_tokens``.
    block_size, use_mrope, dummy_kv_block
        As for :func:`~q12drv.core.staging.stage_batched_attn_metadata`.
    max_blocks_per_seq : int
        Recorded in the metadata (informational; the kernels read each stream's own table).
    num_ssm_layers : int
        State-pointer tables the body reads (:meth:`set_states`): one for each Gated DeltaNet layer and each short
        convolution it runs (Qwen3-Next: two a linear-attention layer).
    state_bytes : int
        Bytes of one stream's recurrent state, for the dummy state absent streams point at.
    expand : {"host", "device"}
        ``"host"``: the capture copies the whole packed block; ``"device"``: it copies the per-stream
        tail and runs the expansion kernel (text positions only).
    stream : optional
        The stream everything is captured on and replayed on.

    Attributes
    ----------
    meta : BatchedAttnMetadata
        The padded metadata the body's kernels take (fixed addresses; ``batch_size`` =
        ``max_streams``, ``total_tokens`` = ``max_tokens``, ``chunk_len`` = ``max_chunk``).
    cu_seqlens, kv_lens : numpy.ndarray
        Host copies of the current batch's padded fields (after :meth:`set_streams`).
    num_ssm_layers : int
        As given: the state tables :meth:`set_state_tables` takes.
    replays : int
    """

    def __init__(self, arena: ScratchArena, *, max_streams: int, max_tokens: int, max_chunk: int | None = None,
                 block_size: int, use_mrope: bool, dummy_kv_block: int, max_blocks_per_seq: int = 0,
                 num_ssm_layers: int = 0, state_bytes: int = 0, expand: str = "host", stream: Any = None):
        if not isinstance(arena, ScratchArena):
            raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")
        if expand not in EXPAND_MODES:
            raise ValueError(f"expand must be one of {EXPAND_MODES}, got {expand!r}")
        for name, v, lo in (("max_streams", max_streams, 1), ("max_tokens", max_tokens, 1),
                            ("num_ssm_layers", num_ssm_layers, 0), ("state_bytes", state_bytes, 0),
                            ("max_blocks_per_seq", max_blocks_per_seq, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        max_chunk = max_tokens if max_chunk is None else max_chunk
        if not 1 <= max_chunk <= max_tokens:
            raise ValueError(f"max_chunk must be in [1, max_tokens={max_tokens}], got {max_chunk}")
        if num_ssm_layers and state_bytes < 4:
            raise ValueError("num_ssm_layers > 0 needs state_bytes (one stream's state) for the dummy state")
        if expand == "device" and max_streams > _EXPAND_MAX_STREAMS:
            raise ValueError(f"the device expansion handles at most {_EXPAND_MAX_STREAMS} streams, got max_streams "
                             f"{max_streams}")
        self.arena, self.device = arena, arena.device
        self.stream = stream
        self._raw = self.device.as_stream(stream)
        self.max_streams, self.max_tokens, self.max_chunk = int(max_streams), int(max_tokens), int(max_chunk)
        self.block_size, self.use_mrope, self.dummy_kv_block = int(block_size), bool(use_mrope), int(dummy_kv_block)
        self.expand = expand
        self.num_ssm_layers = int(num_ssm_layers)
        self.layout = stacked_layout(self.max_streams, self.max_tokens, self.use_mrope)
        self._upload_from = self.layout.tail_offset if expand == "device" else 0
        self._owned: list = []
        self._gdn_plans: dict = {}  # (GdnShape, GdnConfig) -> the plan for the graph's maxima
        arena.reset()
        self.region = arena.reserve("stacked_metadata", self.layout.staged_bytes, offset=0, align=8)
        self.h_region = arena.reserve("h_state_ptrs", state_tables_bytes(self.max_streams, max(1, num_ssm_layers)),
                                      align=8)
        empty_cu = np.zeros(self.max_streams + 1, np.int32)
        self.meta: BatchedAttnMetadata = metadata_at(
            arena, self.region.offset, self.layout, empty_cu, np.zeros(self.max_streams, np.int32),
            chunk_len=self.max_chunk, max_blocks_per_seq=max_blocks_per_seq, block_size=self.block_size,
            use_mrope=self.use_mrope, dummy_kv_block=self.dummy_kv_block)
        self.cu_seqlens, self.kv_lens = empty_cu, np.zeros(self.max_streams, np.int32)
        try:
            self._pinned: PinnedBuffer = self._own(self.device.pinned(self.layout.staged_bytes - self._upload_from,
                                                                      "pass graph metadata"))
            self._tables_pinned = self._own(self.device.pinned(self.h_region.nbytes, "pass graph state tables")) \
                if num_ssm_layers else None
            #: the tables as the host writes them: ``[num_ssm_layers, max_streams]`` u64 over the pinned buffer
            self._tables = np.zeros((0, self.max_streams), np.uint64) if self._tables_pinned is None else \
                self._tables_pinned.array.view(np.uint64).reshape(num_ssm_layers, self.max_streams)
            self._dummy_state = self._own(self.device.alloc(state_bytes, "pass graph dummy state")) if num_ssm_layers else None
            if self._dummy_state is not None:
                self.device.memset(int(self._dummy_state.ptr), 0, state_bytes, stream)
            self._done = self._own(self.device.event())
        except BaseException:
            self.close()
            raise
        self._done_pending = False
        self._batch_set = False
        self._closed = False
        self._generation = arena.generation  # the reservations above hold while it does
        self.graph: Graph | None = None
        self.replays = 0

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    # --- host side: new batch, new states ---------------------------------------------------
    def _wait_for_replay(self) -> None:
        if self._done_pending:
            self._done.synchronize()
            self._done_pending = False

    def set_streams(self, streams: Sequence[StreamStageInfo]) -> None:
        """Pack ``streams`` (padded to the maxima) into the pass's pinned buffer for the next run.

        Same checks as the stager, plus the maxima. Waits for the previous replay first (it may
        still be reading the buffer).

        Raises
        ------
        CapacityError
            More streams, tokens or a longer stream than the pass was sized for.
        ValueError, TypeError
            What the stager refuses; vision ``mrope_positions`` in ``expand="device"`` mode.
        """
        self._require_open()
        batch = validate_streams(streams, self.block_size, self.use_mrope, self.dummy_kv_block)
        if batch.chunk > self.max_chunk:
            raise CapacityError("stacked_metadata chunk", batch.chunk, self.max_chunk,
                                "a stream is longer than the pass's max_chunk (the captured attention grid)")
        if self.expand == "device" and any(mp is not None for mp in batch.mrope):
            raise ValueError("expand='device' writes text positions only; a stream carries mrope_positions")
        if len(batch.count_list) > self.max_streams or batch.total > self.max_tokens:
            raise CapacityError("stacked_metadata", batch.total, self.max_tokens,
                                f"{len(batch.count_list)} streams / {batch.total} tokens exceed the pass's "
                                f"{self.max_streams} streams / {self.max_tokens} tokens")
        self._wait_for_replay()
        cu, kv = pack_padded(batch, self.layout, self.block_size, self.dummy_kv_block, self._pinned.array,
                             tail_only=self.expand == "device")
        self.cu_seqlens, self.kv_lens = cu.copy(), kv.copy()
        self._batch_set = True

    def set_states(self, layer: int, state_ptrs: Sequence[int]) -> None:
        """Write SSM layer ``layer``'s per-stream state pointers (absent streams: the dummy state)."""
        self._require_open()
        if not 0 <= layer < len(self._tables):
            raise IndexError(f"SSM layer {layer} out of range: the pass was made with num_ssm_layers={len(self._tables)}")
        values = self._checked_states(state_ptrs)
        self._wait_for_replay()
        self._tables[layer] = values

    def set_state_tables(self, rows: Sequence[Sequence[int]] | np.ndarray) -> None:
        """:meth:`set_states` for every SSM layer at once: ``rows[layer][b]`` (``num_ssm_layers`` rows of the same
        number of streams, at most ``max_streams``; or an integer array ``[num_ssm_layers, n]``), checked at once.

        Raises
        ------
        ValueError
            Not one row per SSM layer, rows of different lengths, or a pointer :meth:`set_states` refuses (named
            there); nothing is written.
        CapacityError
            More streams than the pass holds.
        """
        self._require_open()
        if len(rows) != len(self._tables):
            raise ValueError(f"{len(rows)} state tables for a pass made with num_ssm_layers={len(self._tables)}")
        n = len(rows[0]) if len(rows) else 0
        if n > self.max_streams:
            raise CapacityError("h_state_ptrs", n, self.max_streams, "more streams than the pass holds")
        table = plain_table(rows, n) if n else None
        if table is None:  # the per-layer checks name what is wrong (every row checked before any is written)
            for layer, row in enumerate(rows):
                if len(row) != n:
                    raise ValueError(f"rows[{layer}] has {len(row)} pointers, rows[0] {n}: one per stream in each")
                self._checked_states(row)
            table = np.array([[int(p) for p in row] for row in rows], np.uint64).reshape(len(rows), n)
        self._wait_for_replay()
        self._tables[:, :n] = table
        if self._dummy_state is not None:
            self._tables[:, n:] = int(self._dummy_state.ptr)

    def _checked_states(self, state_ptrs: Sequence[int]) -> list:
        """``state_ptrs`` as ints, each a non-NULL address in (0, 2**64) (ValueError naming the first that is not),
        padded to ``max_streams`` with the dummy state."""
        if len(state_ptrs) > self.max_streams:
            raise CapacityError("h_state_ptrs", len(state_ptrs), self.max_streams, "more streams than the pass holds")
        values = []
        for b, p in enumerate(state_ptrs):
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 0 < int(p) < 1 << 64:
                raise ValueError(f"state_ptrs[{b}] must be a non-NULL device pointer, got {p!r}")
            values.append(int(p))
        return values + [int(self._dummy_state.ptr)] * (self.max_streams - len(values))

    # --- what the body enqueues ------------------------------------------------------------------
    def state_table(self, layer: int) -> int:
        """Device address of SSM layer ``layer``'s state-pointer table (uploaded with the metadata, before the
        layers run)."""
        if not 0 <= layer < len(self._tables):
            raise IndexError(f"SSM layer {layer} out of range: the pass was made with num_ssm_layers={len(self._tables)}")
        return int(self.h_region.ptr) + state_tables_bytes(self.max_streams, layer)

    def attention_layer(self, q: int, k: int, v: int, k_pool: int, v_pool: int, o: int, shape: AttentionShape, *,
                        num_blocks: int, algo: str = "auto") -> None:
        """RoPE, KV write and attention over the padded pass (as :meth:`Q12Pass.attention_layer`, batched; within
        ``shape.sliding_window`` where it is set).

        Q/K/V/O hold ``max_tokens`` rows; rows past the real tokens are scratch.
        """
        m, dev, st = self.meta, self.device, self.stream
        check_attention_pools(shape)
        ops.attention_entry(algo, shape.head_dim, dev.arch)  # a bad algo raises before the first launch
        window_left = shape.window_left  # and a bad window
        ops.rope(dev, m, q, k, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                 head_dim=shape.head_dim, rotary_dim=shape.rotary_dim, theta=shape.rope_theta,
                 mrope_mode=shape.mrope_mode, sections=shape.mrope_section, scaling=shape.rope_scaling, stream=st)
        ops.kv_write(dev, m, k, v, k_pool, v_pool, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     num_blocks=num_blocks, stream=st)
        ops.attention(dev, m, q, k_pool, v_pool, o, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, scale=shape.scale, algo=algo, window_left=window_left, stream=st)

    def gdn_plan(self, shape: GdnShape, config: GdnConfig = GdnConfig()) -> GdnPlan:
        """The plan of ``config`` for the graph's maxima (``max_streams`` streams of ``max_chunk`` tokens) on its
        device: what :meth:`gdn_layer` launches, and ``workspace_bytes`` the workspace it needs. Made once per
        ``(shape, config)``."""
        key = (shape, config)
        plan = self._gdn_plans.get(key)
        if plan is None:
            plan = self._gdn_plans[key] = plan_gdn(config, shape, self.max_streams, self.max_chunk, self.device)
        return plan

    def gdn_layer(self, layer: int, tensors: GdnTensors, shape: GdnShape, *, config: GdnConfig | GdnPlan = GdnConfig(),
                  workspace: int | None = None, workspace_bytes: int | None = None) -> None:
        """Gated DeltaNet over the padded pass with SSM layer ``layer``'s state table (:meth:`set_states`)
        (``config``, ``workspace`` and ``workspace_bytes`` as for :func:`q12drv.kernels.gdn.gdn`; the plan is made
        for the graph's maxima, :meth:`gdn_plan`, so is the workspace)."""
        plan = self.gdn_plan(shape, config) if isinstance(config, GdnConfig) else config
        gdn(self.device, self.meta, self.state_table(layer), tensors, shape, plan, workspace=workspace,
            workspace_bytes=workspace_bytes, stream=self.stream)

    def conv1d(self, table: int, x: int, y: int, w: int, *, channels: int, width: int = 4, bias: int | None = None,
               x_stride: int | None = None, y_stride: int | None = None, state_stride: int | None = None,
               silu: bool = True) -> None:
        """The short convolution over the padded pass (as :meth:`Q12Pass.conv1d`, batched: :func:`q12drv.kernels.conv1d
        .conv1d`'s arguments, raw addresses) with state table ``table`` (:meth:`set_states`: each stream's bf16
        ``[W - 1, C]`` state; absent streams have no tokens, so the dummy state they point at is never read). X and
        Y hold ``max_tokens`` rows; rows past the real tokens are scratch."""
        _conv1d(self.device, self.meta, self.state_table(table), x, y, w, channels=channels, width=width, bias=bias,
                x_stride=x_stride, y_stride=y_stride, state_stride=state_stride, silu=silu, stream=self.stream)

    def _enqueue_metadata(self) -> None:
        dst = int(self.region.ptr) + self._upload_from
        self.device.use()
        self.device.driver.memcpy_htod_async(dst, self._pinned.addr, self._pinned.nbytes, self._raw)
        if self._tables_pinned is not None:  # every SSM layer's table, one copy
            self.device.driver.memcpy_htod_async(int(self.h_region.ptr), self._tables_pinned.addr,
                                                 self.h_region.nbytes, self._raw)
        if self.expand == "device":  # self.meta: max_streams streams of max_chunk tokens, the padded grid
            enqueue_expand(ops.prepared(self.device, "q12_expand_meta"), self.meta, self.stream)

    # --- running ---------------------------------------------------------------------------------
    def run_eager(self, body: Callable[["PassGraph"], None]) -> None:
        """Enqueue the metadata upload and ``body(self)`` without a graph (what a replay does)."""
        self._require_batch()
        self._wait_for_replay()
        self._enqueue_metadata()
        body(self)
        self._record_done()

    def capture(self, body: Callable[["PassGraph"], None]) -> Graph:
        """Run ``body(self)`` once eagerly (loading and checking everything), then capture the pass.

        ``body`` enqueues the layer kernels on the pass's stream using :attr:`meta` (e.g. through
        :meth:`attention_layer` and :meth:`gdn_layer`). The eager run computes a real result for
        the current batch; the capture records without running.
        """
        self._require_batch()
        if self.graph is not None:
            self.graph.destroy()
            self.graph = None
        self.run_eager(body)
        self.device.synchronize(self.stream)
        self._done_pending = False
        with capture(self.device, self.stream) as graph:
            self._enqueue_metadata()
            body(self)
        self.graph = self._own(graph)
        return graph

    def replay(self) -> None:
        """Enqueue the captured pass for the batch last given to :meth:`set_streams` (one driver call)."""
        self._require_batch()
        if self.graph is None:
            raise Q12Error("capture the pass first (PassGraph.capture)")
        self.graph.launch(self.stream)
        self._record_done()
        self.replays += 1

    def _record_done(self) -> None:
        self.device.use()
        self.device.driver.event_record(self._done.raw, self._raw)
        self._done_pending = True

    def _require_open(self) -> None:
        if self._closed:
            raise Q12Error("this PassGraph is closed (its pinned buffers are freed); make a new one")

    def _require_batch(self) -> None:
        self._require_open()
        if self.arena.generation != self._generation:
            raise Q12Error("the arena was reset since this PassGraph was made (by a Q12Pass on it, or grown by "
                           "ScratchArena.grow): its metadata region may hold other bytes; make a new PassGraph")
        if not self._batch_set:
            raise Q12Error("no batch: call PassGraph.set_streams(streams) first")

    def close(self) -> None:
        """Wait for a pending replay and free the graph, the pinned buffers and the dummy state."""
        self._closed = True
        self._tables = np.zeros((0, self.max_streams), np.uint64)  # no view of the freed pinned buffer is left
        if self.device.closed:
            self._owned.clear()
            return
        try:
            if getattr(self, "_done_pending", False):
                self._done.synchronize()
        finally:
            for obj in reversed(self._owned):
                release = getattr(obj, "free", None) or getattr(obj, "destroy", None)
                try:
                    release()
                except Exception:
                    pass
            self._owned.clear()
            self.graph = None

    def __enter__(self) -> "PassGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
