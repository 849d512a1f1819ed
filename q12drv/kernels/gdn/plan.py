"""Which GDN kernels a layer runs: the independent choices (:class:`GdnConfig`), the rules that resolve each
``"auto"`` for a device and a batch (:func:`plan_gdn`), and the frozen result (:class:`GdnPlan`).

Every path computes the same recurrence (:mod:`.reference`); they differ in speed, in whether they need a workspace,
and in their rounding (:attr:`GdnPlan.numerics`). A plan's kernels give the same bits for a batch and for each of
its streams alone (a CTA never mixes streams), so a pass that plans once from its whole batch and runs that plan
batched or stream by stream gets the same bits either way; two plans that chose differently need not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..args import count, head_group
from . import chunked_mma as _mma
from . import chunked_wgmma as _wg
from . import recurrent as _rec

__all__ = ["GdnShape", "GdnConfig", "GdnKernel", "GdnPlan", "plan_gdn", "check_shape", "MATHS", "SCHEDULES", "ISAS",
           "PATHS", "HOPPER", "RECURRENT_MAX_TOKENS", "DECODE_MAX_TOKENS"]

#: ``GdnConfig.math``: the chunked (WY) form on tensor cores, the fp32 token-by-token recurrence, or ``"auto"`` (the
#: rules': the recurrence for decode-sized passes, :data:`RECURRENT_MAX_TOKENS`).
MATHS = ("auto", "chunked", "recurrent")
#: ``math="auto"`` runs the recurrence when the longest stream of the pass has at most this many tokens (a decode or
#: speculative-decode step), with ``schedule`` and ``isa`` left ``"auto"``. Measured on the H200 (64 streams, Hv 32,
#: d 128) against the chunked form, which pads every stream to a 64-token chunk: 0.44x its time at 1 token a stream,
#: 0.60x at 4, 0.85x at 8 (the token-chunked build), 1.19x at 16. Longer streams: the chunked form.
RECURRENT_MAX_TOKENS = 8
#: The recurrence runs its decode build (one coalesced pass over the state) up to this many tokens a stream, its
#: token-chunked build beyond. Measured on the H200 (64 streams, Hv 32, d 128): the decode build 77.1 us at 1 token,
#: 96.5 at 4, 146.0 at 8 (the token-chunked build 174.2, the chunked form 199.0), 198.7 at 12 (chunked 203.7).
DECODE_MAX_TOKENS = 8
#: ``GdnConfig.schedule``: ``"fused"`` one launch; ``"two_pass"`` a precompute into a workspace, then the sequential
#: walk; ``"overlapped"`` the precompute running beside the sequential kernel; ``"auto"`` the rules'.
SCHEDULES = ("auto", "fused", "two_pass", "overlapped")
#: ``GdnConfig.isa``: mma.sync (any sm_90 build), Hopper's warpgroup MMA, or ``"auto"`` (the device's best).
ISAS = ("auto", "mma", "wgmma")
#: The ``(math, schedule, isa)`` paths with kernels (the recurrent kernel runs on fp32 CUDA cores).
PATHS = (("chunked", "fused", "mma"), ("chunked", "two_pass", "mma"), ("chunked", "two_pass", "wgmma"),
         ("chunked", "overlapped", "wgmma"), ("recurrent", "fused", "fp32"))
#: Architectures with warpgroup MMA.
HOPPER = ("sm_90", "sm_90a")


@dataclass(frozen=True)
class GdnShape:
    """Shape of a Gated DeltaNet layer: key heads, value heads (a multiple of them), head dim (dk = dv, 64 or 128)."""

    num_k_heads: int
    num_v_heads: int
    head_dim: int


def check_shape(shape) -> tuple[int, int, int]:
    """``(Hk, Hv, d)`` of ``shape``, checked: a :class:`GdnShape` of positive C ints, Hv a multiple of Hk, a head
    dim with kernels (TypeError/ValueError naming the field)."""
    if not isinstance(shape, GdnShape):
        raise TypeError(f"shape must be a GdnShape, got {type(shape).__name__}")
    hv, hk = head_group("shape.num_v_heads", shape.num_v_heads, "shape.num_k_heads", shape.num_k_heads)
    d = count("shape.head_dim", shape.head_dim)
    _rec.entry(d)
    return hk, hv, d


@dataclass(frozen=True)
class GdnConfig:
    """The independent choices of a GDN layer; each ``"auto"`` is resolved by :func:`plan_gdn`.

    Parameters
    ----------
    math : {"auto", "chunked", "recurrent"}
        The chunked (WY) form on tensor cores, 64 tokens at a time, or the fp32 token-by-token recurrence (the
        reference: slow on long streams, the fastest on a decode step). ``"auto"`` (default): the recurrence when
        the pass's longest stream has at most :data:`RECURRENT_MAX_TOKENS` tokens and ``schedule`` and ``isa`` are
        ``"auto"``, else the chunked form.
    schedule : {"auto", "fused", "two_pass", "overlapped"}
        ``"fused"``: one launch, no workspace. ``"two_pass"``: a precompute kernel writes every chunk's
        state-independent work into a workspace in parallel, then the sequential kernel walks the chunks. ``"overlapped"``
        (wgmma): the precompute runs beside the sequential kernel (for few sequential CTAs and one long stream).
        ``"auto"`` (default): the rules (:func:`plan_gdn`); it never falls back to ``"fused"`` for want of a
        workspace.
    isa : {"auto", "mma", "wgmma"}
        mma.sync, or Hopper's warpgroup MMA (sm_90); ``"auto"`` (default): the device's best.
    """

    math: str = "auto"
    schedule: str = "auto"
    isa: str = "auto"

    def __post_init__(self):
        for name, value, choices in (("math", self.math, MATHS), ("schedule", self.schedule, SCHEDULES),
                                     ("isa", self.isa, ISAS)):
            if type(value) is not str or value not in choices:
                raise ValueError(f"GdnConfig.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class GdnKernel:
    """One launch of a plan: its entry, geometry, dynamic shared memory, and whether it is launched with
    programmatic stream serialization (it then synchronises with the previous kernel itself)."""

    entry: str
    grid: tuple
    block: tuple
    smem: int
    dependent: bool


def _paths_text() -> str:
    return ", ".join(f"{m} {s} on {i}" if m == "chunked" else f"{m} (schedule 'fused')" for m, s, i in PATHS)


def _resolve(config: GdnConfig, hv: int, d: int, n: int, max_tokens: int, arch: str, sms: int) -> tuple:
    """``(math, schedule, isa)`` of ``config`` on this device for this batch (the rules), or ValueError naming what
    exists."""
    math, schedule, isa = config.math, config.schedule, config.isa
    if math == "auto":
        math = "recurrent" if max_tokens <= RECURRENT_MAX_TOKENS and schedule == isa == "auto" else "chunked"
    if math == "recurrent":
        if schedule not in ("auto", "fused") or isa != "auto":
            raise ValueError(f"{config} has no kernel: math='recurrent' is one launch on fp32 CUDA cores (leave "
                             f"schedule and isa 'auto'); the paths with kernels: {_paths_text()}")
        return math, "fused", "fp32"
    hopper = arch in HOPPER
    if isa == "auto":   # the device's best that has the schedule asked for
        isa = "mma" if schedule == "fused" else "wgmma" if hopper or schedule == "overlapped" else "mma"
    if isa == "wgmma" and not hopper:
        raise ValueError(f"{config} needs warpgroup MMA (Hopper, sm_90), this device is {arch}: use isa='mma' (the "
                         f"schedules 'fused' and 'two_pass')")
    if schedule == "auto":
        schedule = ("overlapped" if isa == "wgmma" and _wg.uses_overlapped(n, max_tokens, hv, d, sms) else "two_pass")
    if ("chunked", schedule, isa) not in PATHS:
        raise ValueError(f"{config} has no kernel (schedule {schedule!r} on isa {isa!r}); the paths with kernels: "
                         f"{_paths_text()}")
    return math, schedule, isa


def _build(math: str, schedule: str, isa: str, hv: int, d: int, n: int, max_tokens: int, sms: int) -> str:
    """The build the rules take: the recurrence's ``"decode"`` one for at most :data:`DECODE_MAX_TOKENS` tokens a
    stream (``""``, the token-chunked one, for longer); the two-pass sequential kernel's ``"wide"`` (wgmma, a full
    device at d128), else ``"1stage"`` or ``"2stage"`` by grid size; ``""`` for the other schedules."""
    if math == "recurrent":
        return "decode" if max_tokens <= DECODE_MAX_TOKENS else ""
    if schedule != "two_pass":
        return ""
    if isa == "wgmma" and _wg.uses_wide(n, hv, d, sms):
        return "wide"
    stages = (_wg if isa == "wgmma" else _mma).sequential_stages(n, hv, d, sms)
    return f"{stages}stage"


@lru_cache(maxsize=1024)
def _launches(math: str, schedule: str, isa: str, build: str, hk: int, hv: int, d: int, n: int, max_tokens: int,
              sms: int) -> tuple:
    """``(zero, kernels)`` of a resolved path over ``n`` streams of at most ``max_tokens`` tokens: ``zero``, the
    workspace ``(offset, bytes)`` cleared before the launches (the overlapped schedule's ready flags and item
    counter) or None; ``kernels``, the :class:`GdnKernel` launches in order."""
    if math == "recurrent":
        if build == "decode":
            return None, (GdnKernel(_rec.decode_entry(d), *_rec.decode_geometry(n, hv, d), False),)
        return None, (GdnKernel(_rec.entry(d), *_rec.geometry(n, hv, d), False),)
    if schedule == "fused":
        return None, (GdnKernel(_mma.fused_entry(d), *_mma.fused_geometry(n, hv, d), False),)
    if schedule == "overlapped":
        zero = (_wg.flags_offset(n, max_tokens, hk, hv, d), _wg.flags_bytes(n, max_tokens, hk))
        prep, seq = _wg.overlapped_geometry(n, hv, d, sms)
        prep_e, seq_e = _wg.overlapped_entries(d)
        return zero, (GdnKernel(prep_e, *prep, False), GdnKernel(seq_e, *seq, True))
    prep = GdnKernel(_mma.precompute_entry(d, isa), *_mma.precompute_geometry(n, max_tokens, hk, d), False)
    if isa == "mma":   # the sequential kernel after the precompute, in stream order
        stages = int(build[0])
        return None, (prep, GdnKernel(_mma.sequential_entry(d, stages), *_mma.sequential_geometry(n, hv, d, stages),
                                      False))
    # wgmma: the sequential kernel by PDL (it loads its inputs and state while the precompute finishes)
    if build == "wide":
        return None, (prep, GdnKernel(_wg.WIDE_ENTRY, *_wg.wide_geometry(n, hv), True))
    stages = int(build[0])
    return None, (prep, GdnKernel(_wg.sequential_entry(d, stages), *_wg.sequential_geometry(n, hv, d, stages), True))


def _workspace_bytes(schedule: str, isa: str, hk: int, hv: int, d: int, n: int, max_tokens: int) -> int:
    if schedule == "two_pass":
        return (_mma.mma_workspace_bytes(n, max_tokens, hk, hv, d) if isa == "mma"
                else _mma.t_workspace_bytes(n, max_tokens, hk, hv))
    if schedule == "overlapped":
        return _wg.overlapped_workspace_bytes(n, max_tokens, hk, hv, d)
    return 0


@dataclass(frozen=True)
class GdnPlan:
    """The kernels a GDN layer runs, resolved from a :class:`GdnConfig` for one device and at most ``n_streams``
    streams of at most ``max_tokens`` tokens (:func:`plan_gdn`).

    Attributes
    ----------
    config : GdnConfig
        What was asked.
    shape : GdnShape
    n_streams, max_tokens : int
        The extent planned for: a launch may cover fewer streams or tokens (a pass run stream by stream) with the
        same kernels, never more.
    arch : str
    sm_count : int
        The device planned for (the rules and the overlapped precompute's grid take its SM count).
    math : {"chunked", "recurrent"}
        Resolved (``"auto"``'s choice).
    schedule : {"fused", "two_pass", "overlapped"}
    isa : {"fp32", "mma", "wgmma"}
        The instruction set of the chosen kernels (``"fp32"``: the recurrent kernel, no tensor cores).
    build : str
        The kernels' build: the two-pass sequential kernel's ``"2stage"``, ``"1stage"`` or ``"wide"``; the recurrence's
        ``"decode"`` (at most :data:`DECODE_MAX_TOKENS` tokens a stream); ``""`` otherwise.
    kernels : tuple of GdnKernel
        The launches, in order, for the planned extent.
    zero : tuple of int or None
        ``(offset, bytes)`` of the workspace cleared before the launches (the overlapped schedule's flags).
    workspace_bytes : int
        The workspace the planned extent needs (0: none).
    """

    config: GdnConfig
    shape: GdnShape
    n_streams: int
    max_tokens: int
    arch: str
    sm_count: int
    math: str
    schedule: str
    isa: str
    build: str
    kernels: tuple
    zero: tuple | None
    workspace_bytes: int

    @property
    def numerics(self) -> str:
        """Whose rounding the results have: ``"recurrent"`` (fp32 throughout), or the chunked paths'
        (:data:`~.reference.REFERENCE_PATHS`, the ``path`` of :func:`~.reference.chunked_reference`): ``"mma"``
        (fused and mma two-pass: one set of bits), ``"wgmma"`` (the wgmma two-pass schedule), ``"overlapped"``."""
        if self.math == "recurrent":
            return "recurrent"
        return "overlapped" if self.schedule == "overlapped" else self.isa

    def launches(self, n_streams: int, max_tokens: int) -> tuple:
        """``(zero, kernels)`` for a launch over ``n_streams`` streams of at most ``max_tokens`` tokens, within the
        planned extent: the same entries, the geometry of that launch (see :attr:`kernels`, :attr:`zero`)."""
        return _launches(self.math, self.schedule, self.isa, self.build, self.shape.num_k_heads,
                         self.shape.num_v_heads, self.shape.head_dim, n_streams, max_tokens, self.sm_count)

    def workspace_bytes_for(self, n_streams: int, max_tokens: int) -> int:
        """The workspace a launch over ``n_streams`` streams of at most ``max_tokens`` tokens needs (0: none)."""
        return _workspace_bytes(self.schedule, self.isa, self.shape.num_k_heads, self.shape.num_v_heads,
                                self.shape.head_dim, n_streams, max_tokens)

    def check_covers(self, shape, n_streams: int, max_tokens: int, arch: str) -> None:
        """Raise ValueError unless this plan was made for ``shape`` and a device of ``arch`` and covers
        ``n_streams`` streams of at most ``max_tokens`` tokens (plan again with :func:`plan_gdn` for more)."""
        if shape != self.shape:
            raise ValueError(f"the plan was made for {self.shape}, not {shape}: plan again (plan_gdn)")
        if self.isa == "wgmma" and arch not in HOPPER:
            raise ValueError(f"the plan's kernels need warpgroup MMA (it was made for {self.arch}), this device is "
                             f"{arch}: plan again on this device")
        if n_streams > self.n_streams or max_tokens > self.max_tokens:
            raise ValueError(f"the plan covers {self.n_streams} stream(s) of at most {self.max_tokens} tokens, this "
                             f"launch has {n_streams} of up to {max_tokens}: plan again with the larger extent "
                             f"(plan_gdn)")


#: (config, (Hk, Hv, d), n, max_tokens, arch, sms) -> the plan: a plan is immutable and a pure function of these.
_PLANS: dict = {}


def plan_gdn(config: GdnConfig, shape: GdnShape, n_streams: int, max_tokens: int, device) -> GdnPlan:
    """Resolve ``config`` for ``shape`` on ``device`` for at most ``n_streams`` streams of at most ``max_tokens``
    tokens: the kernels, their geometry and the workspace they need.

    The rules for each ``"auto"``: ``math`` the recurrence for a pass of at most :data:`RECURRENT_MAX_TOKENS` tokens a
    stream (schedule and isa ``"auto"``), else the chunked form (the recurrence, asked for or chosen, runs its decode
    build up to :data:`DECODE_MAX_TOKENS` tokens a stream, its token-chunked build beyond); ``isa`` the device's best
    (wgmma on Hopper, sm_90; mma.sync elsewhere, and for ``schedule="fused"``, which has no wgmma kernel); ``schedule``
    on wgmma ``"overlapped"`` when the sequential grid (``n * Hv * dv / 64`` CTAs) leaves at least half of the SMs
    free and the longest stream has 8192 tokens or more, else ``"two_pass"`` (mma.sync: ``"two_pass"``, faster than
    ``"fused"`` on every case measured); the
    two-pass sequential kernel: on wgmma the wide CTA where its grid fills two CTAs an SM at d128, else one stage
    where the grid fills two CTAs an SM, two stages below that.

    Parameters
    ----------
    config : GdnConfig
    shape : GdnShape
    n_streams : int
        Streams a launch of the plan may cover (a pass's batch).
    max_tokens : int
        Tokens of the longest stream (a pass's longest count; ``meta.chunk_len``).
    device : Device
        Anything with ``arch`` (``"sm_90"``...) and ``sm_count``.

    Returns
    -------
    GdnPlan

    Raises
    ------
    TypeError, ValueError
        A bad argument; a combination without a kernel (the message lists the paths that have one); wgmma asked
        for on a device without it.
    """
    if not isinstance(config, GdnConfig):
        raise TypeError(f"config must be a GdnConfig, got {type(config).__name__}")
    hk, hv, d = check_shape(shape)
    n = count("n_streams", n_streams)
    tokens = count("max_tokens", max_tokens, 0)
    arch, sms = str(device.arch), count("device.sm_count", device.sm_count)
    key = (config, hk, hv, d, n, tokens, arch, sms)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    math, schedule, isa = _resolve(config, hv, d, n, tokens, arch, sms)
    build = _build(math, schedule, isa, hv, d, n, tokens, sms)
    zero, kernels = _launches(math, schedule, isa, build, hk, hv, d, n, tokens, sms)
    plan = GdnPlan(config, GdnShape(hk, hv, d), n, tokens, arch, sms, math, schedule, isa, build, kernels,
                   zero, _workspace_bytes(schedule, isa, hk, hv, d, n, tokens))
    if len(_PLANS) >= 1024:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan
