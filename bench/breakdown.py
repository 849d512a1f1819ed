#!/usr/bin/env python3
"""Where the 8 x 128 step's round trip goes, and why staging's host time grows right after a sync.

    PYTHONPATH=. python3 bench/breakdown.py --out /tmp/breakdown.json     # the GPU: ~10-20 s warm
    PYTHONPATH=. python3 bench/breakdown.py --driver emu --reps 3         # plumbing check (cut-down shapes)

Sections (``--sections step,staging``; every median is over ``--reps`` repetitions, default 200):

* ``step``: the 8 x 128 Qwen3-Next-like step as ``bench.inputs.StepCase`` runs it (``Q12Pass`` +
  one attention layer + one Gated DeltaNet layer), batched and per stream:

  - *plain*: host time and round trip of ``StepCase.run(mode)`` with nothing instrumented, each
    mode alone and both interleaved (as ``gpu_compare.py``'s step section measures them);
  - *host phases*: the same pass split into the constructor's phases (validation, admission, prefix
    regions, staging, the h_state slot, the rest) and each layer's (checks, each enqueue, the
    h_state_ptrs upload, the rest), timed by wrappers around those functions (a few tenths of a us each);
  - *ops*: every launch and copy of the pass in order, an event recorded after each. *GPU (gated)*:
    the whole pass is enqueued behind a memset long enough to hold the stream (``held`` says how often it
    did), so consecutive events time each op alone, back to back: their sum is the pass's GPU time.
    *ungated*: the same right after a sync, as a pass really runs: when the host finished enqueueing each op
    and when the device finished it (event clock since an event recorded at the pass's start: the
    device's lag behind the host shows who waits for whom). The per-stream pass's staging ring is given
    enough slots for the gated run (3 slots would make the host wait for the gated copies).

* ``staging``: 8 x 2048 MRoPE through ``ExpandPlan.stage`` (``StagingCase.planned``: ``arena.reset()`` +
  ``plan.stage``), the plan's own bound launch (``Launch.bind``, what ``stage`` calls), a raw pre-packed
  ``cuLaunchKernel`` of the same kernel with the plan's argument block (through cuda-bindings and, on the GPU,
  through ctypes straight into libcuda: what the bindings' wrapper costs), and one bare
  ``cuMemcpyHtoDAsync`` of ``staged_bytes``. Host time of one call (a) back to back (no sync between calls),
  (b) right after a sync that waited for the previous call's work, (c) the same with a 200 us busy-wait
  (spinning on ``perf_counter``) between the sync and the call, (d) as ``bench.timing.host_and_round_trip``
  measures it (the paths interleaved, an idle-stream sync before each call); plus each one's GPU time.
  Read: a penalty in (b) that (c) removes is the thread/CPU waking up; one that (c) keeps and the raw
  launch or the copy shares is the driver's; one only ``plan.stage`` pays is Python's (cold caches).

A short table comes last. Nothing is asserted: this is a diagnostic.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import q12drv  # noqa: E402
from bench import inputs, report  # noqa: E402
from bench.timing import host_and_round_trip, q12_events_us  # noqa: E402
from q12drv.prefill import q12pass as prefill  # noqa: E402
from q12drv.core import staging  # noqa: E402
from q12drv.kernels import expand  # noqa: E402
from q12drv.kernels.gdn.launch import GdnLaunch  # noqa: E402
from q12drv.kernels.registry import prepared_launches  # noqa: E402
from q12drv.core.pinned import PinnedRing  # noqa: E402
from q12drv.prefill import Q12Pass  # noqa: E402

pc = time.perf_counter
RESULTS: dict = {"meta": {}, "step": {}, "staging": {}, "floors": {}, "errors": {}}


def med(xs) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def after_sync(fn, reps: int, sync, spin_us: float) -> list:
    """Host times (us) of ``fn()``, each right after ``sync()`` (and a ``spin_us`` busy-wait, if any)."""
    xs = []
    fn()
    for _ in range(reps):
        sync()
        if spin_us:
            spin(spin_us)
        t0 = pc()
        fn()
        xs.append((pc() - t0) * 1e6)
    return xs


def spin(us: float) -> None:
    end = pc() + us * 1e-6
    while pc() < end:
        pass


def fmt(x) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:,.1f}" if abs(x) < 1e4 else f"{x:,.0f}"


# ----------------------------------------------------------------------------- instrumentation
class Tracer:
    """Events recorded after every launch and host-to-device copy while ``on``: (label, host time, event)."""

    def __init__(self, dev, size: int = 256):
        self.dev = dev
        self.events = [dev.event(timing=True) for _ in range(size)]
        self.record = dev.driver.event_record
        self.marks: list = []
        self.on = False
        self._restore: list = []

    def begin(self, stream) -> None:
        ev = self.events[0]
        self.record(ev.raw, stream)
        self.marks = [("start", pc(), ev)]
        self.on = True

    def end(self) -> None:
        self.on = False

    def mark(self, label, stream) -> None:
        if not self.on:
            return
        t = pc()
        ev = self.events[len(self.marks)]
        self.record(ev.raw, stream)
        self.marks.append((label, t, ev))

    def install(self) -> None:
        """Wrap the fire of every prepared launch on the device, and the driver's H2D copies, memsets and
        dependent launches (where it has them)."""
        dev, drv = self.dev, self.dev.driver
        names = {}
        for entry, launch in list(prepared_launches(dev).items()):
            self._wrap_launch(launch, entry)
            names[id(launch.kernel.func)] = entry

        def htod(dst, src, nbytes, stream, _orig=drv.memcpy_htod_async, _mark=self.mark):
            _orig(dst, src, nbytes, stream)
            _mark(("H2D", nbytes), stream)

        def memset(dst, value, nbytes, stream, _orig=drv.memset_d8_async, _mark=self.mark):
            _orig(dst, value, nbytes, stream)
            _mark(("memset", nbytes), stream)

        self._patch(drv, "memcpy_htod_async", htod)
        self._patch(drv, "memset_d8_async", memset)
        if hasattr(drv, "launch_dependent"):
            def dependent(func, grid, block, smem, stream, params_addr, _orig=drv.launch_dependent, _mark=self.mark):
                _orig(func, grid, block, smem, stream, params_addr)
                _mark((names.get(id(func), "kernel") + " (dependent)", tuple(grid)), stream)

            self._patch(drv, "launch_dependent", dependent)

    def _patch(self, obj, name: str, fn) -> None:
        had, orig = name in vars(obj), getattr(obj, name)
        setattr(obj, name, fn)
        self._restore.append(lambda: setattr(obj, name, orig) if had else delattr(obj, name))

    def _wrap_launch(self, launch, name: str) -> None:
        orig = launch.fire

        def fire(grid, block, smem, stream, _orig=orig, _mark=self.mark, _name=name):
            _orig(grid, block, smem, stream)
            _mark((_name, tuple(grid)), stream)

        launch.fire = fire
        self._restore.append(lambda: setattr(launch, "fire", orig))

    def uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()

    def read(self) -> list:
        """``[(label, host us since begin, device us since begin)]`` of the last pass (after a sync)."""
        (_, t0, e0), out = self.marks[0], []
        for label, t, ev in self.marks[1:]:
            out.append((label, (t - t0) * 1e6, e0.elapsed_ms(ev) * 1e3))
        return out

    def close(self) -> None:
        self.uninstall()
        for ev in self.events:
            ev.destroy()


def label_text(label) -> str:
    if label[0] == "H2D":
        return f"H2D copy {label[1]:,} B"
    if label[0] == "memset":
        return f"memset {label[1]:,} B"
    return f"{label[0]} grid" + str(label[1]).replace(" ", "")


#: (owner, attribute or alternatives (the first present is wrapped), phase): the functions the host-phase view
#: times, as the step path calls them.
HOOKS = [
    (prefill, "validate_streams", "init: validate streams"),
    (prefill, ("_admit", "decide"), "init: admission (decide)"),
    (Q12Pass, "_reserve_prefix", "init: prefix regions"),
    (prefill, "stage_on_device", "init: staging (device expansion)"),
    (prefill, "stage_stacked", "init: staging (host pack)"),
    (prefill, "stage_stream_metadata", "init: staging (per-stream blocks)"),
    (prefill, "place_h_state_slot", "init: h_state slot"),
    (prefill, "reserve_h_state_slot", "init: h_state slot"),
    (Q12Pass, "_attention_ops", "attention: checks"),
    (Q12Pass, "_rope_launch", "attention: launches made (once a pass)"),
    (Q12Pass, "_kv_write_launch", "attention: launches made (once a pass)"),
    (Q12Pass, "_attention_launch", "attention: launches made (once a pass)"),
    (Q12Pass, "_check_gdn", "gdn: checks"),
    (Q12Pass, "_gdn_layer", "gdn: plan, workspace, launches made (once a pass)"),
    (staging.HStateSlot, "write_checked", "gdn: h_state_ptrs upload"),
    (GdnLaunch, "launch", "gdn: launches"),
]
PHASE_ORDER = ["init", "attention", "gdn"]


class PhaseHooks:
    """Timing wrappers around :data:`HOOKS` (installed, then removed): seconds per phase, summed over a pass."""

    def __init__(self):
        self.acc = collections.defaultdict(float)
        self._restore = []

    def __enter__(self):
        acc = self.acc
        for owner, attrs, phase in HOOKS:
            for attr in (attrs,) if isinstance(attrs, str) else attrs:  # the first one there
                orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
                if orig is not None and callable(orig):
                    break
            else:
                continue  # renamed or inlined: its time shows under "other"

            def wrapped(*a, _orig=orig, _phase=phase, **k):
                t = pc()
                try:
                    return _orig(*a, **k)
                finally:
                    acc[_phase] += pc() - t

            setattr(owner, attr, wrapped)
            self._restore.append((owner, attr, orig))
        return self

    def __exit__(self, *exc):
        while self._restore:
            owner, attr, orig = self._restore.pop()
            setattr(owner, attr, orig)


# ----------------------------------------------------------------------------- the step
def split_run(step, mode):
    """``StepCase.run(mode)`` (one attention + one GDN layer) with the same arguments, its three calls timed."""
    p = step.ptrs
    t0 = pc()
    q12 = Q12Pass(step.arena, step.streams, block_size=step.bs, use_mrope=False, dummy_kv_block=0,
                  head_dim=step.att.head_dim, policy="exact", mode=mode)
    t1 = pc()
    q12.attention_layer(p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], step.att, num_blocks=step.num_blocks)
    t2 = pc()
    q12.gdn_layer(step.state_ptrs, step.gdn_tensors, step.gdn, **step.gdn_kwargs())
    t3 = pc()
    return q12, (t1 - t0, t2 - t1, t3 - t2)


def plain(step, modes, reps, sync) -> dict:
    """Host time and round trip of ``step.run(mode)``, uninstrumented: ``modes`` interleaved per repetition."""
    host = {m: [] for m in modes}
    rt = {m: [] for m in modes}
    for _ in range(reps):
        for m in modes:
            sync()
            t0 = pc()
            step.run(m)
            t1 = pc()
            sync()
            t2 = pc()
            host[m].append((t1 - t0) * 1e6)
            rt[m].append((t2 - t0) * 1e6)
    return {m: {"host_us": med(host[m]), "round_trip_us": med(rt[m])} for m in modes}


def host_phases(step, mode, reps, sync) -> dict:
    per = collections.defaultdict(list)
    with PhaseHooks() as hooks:
        for _ in range(reps):
            sync()
            hooks.acc.clear()
            _, (ti, ta, tg) = split_run(step, mode)
            totals = {"init": ti, "attention": ta, "gdn": tg}
            inner = collections.defaultdict(float)
            for phase, s in hooks.acc.items():
                per[phase].append(s * 1e6)
                inner[phase.split(":")[0]] += s
            for top, s in totals.items():
                per[f"{top}: total"].append(s * 1e6)
                per[f"{top}: other"].append((s - inner[top]) * 1e6)
            per["pass: total"].append((ti + ta + tg) * 1e6)
    sync()
    return {k: med(v) for k, v in per.items()}


def _aligned(runs: list) -> tuple:
    """The most common op sequence among ``runs`` and the runs that have it."""
    seqs = collections.Counter(tuple(label for label, _, _ in r) for r in runs)
    labels, _ = seqs.most_common(1)[0]
    return labels, [r for r in runs if tuple(label for label, _, _ in r) == labels]


def traced(step, mode, reps, sync, tracer, gate=None, warm: int = 3) -> dict:
    """Every op of the pass with its times (see the module doc); ``gate``: the :class:`Gate` to enqueue first,
    or None. The first ``warm`` repetitions are not counted (a fresh ring's pinned slots are allocated there)."""
    dev = step.dev
    stream = dev.stream.raw
    runs, hosts, rts, held = [], [], [], 0
    for i in range(reps + warm):
        sync()
        if gate is not None:
            gate()
        t0 = pc()
        tracer.begin(stream)
        split_run(step, mode)
        t1 = pc()
        tracer.end()
        if gate is not None:
            held += not tracer.marks[0][2].query()  # the pass's start event still behind the gate
        sync()
        t2 = pc()
        if i < warm:
            held = 0
            continue
        runs.append(tracer.read())
        hosts.append((t1 - t0) * 1e6)
        rts.append((t2 - t0) * 1e6)
    labels, good = _aligned(runs)
    ops_out = []
    for i, label in enumerate(labels):
        host_at = med([r[i][1] for r in good])
        dev_at = med([r[i][2] for r in good])
        dt = med([r[i][2] - (r[i - 1][2] if i else 0.0) for r in good])
        ops_out.append({"op": label_text(label), "host_at_us": host_at, "device_at_us": dev_at, "device_dt_us": dt})
    return {"ops": ops_out, "host_us": med(hosts), "round_trip_us": med(rts), "held": held,
            "reps": reps, "aligned_reps": len(good),
            "device_end_us": med([r[-1][2] for r in good]) if labels else float("nan")}


class Gate:
    """Memsets on a scratch buffer that keep the stream busy for about ``us`` microseconds."""

    def __init__(self, dev, gpu: bool):
        self.dev = dev
        self.nbytes = (256 << 20) if gpu else (1 << 16)
        self.buf = dev.alloc(self.nbytes, "breakdown gate")
        self.count = 1
        self.us_per_memset = self._time_one()

    def _time_one(self) -> float:
        dev = self.dev
        a, b = dev.event(timing=True), dev.event(timing=True)
        times = []
        try:
            for _ in range(5):
                dev.synchronize()
                a.record()
                dev.memset(int(self.buf.ptr), 0, self.nbytes)
                b.record()
                b.synchronize()
                times.append(a.elapsed_ms(b) * 1e3)
        finally:
            a.destroy()
            b.destroy()
        return max(med(times[1:]), 1e-3)

    def size_for(self, us: float) -> None:
        self.count = max(1, min(64, int(us / self.us_per_memset) + 1))

    def __call__(self) -> None:
        for _ in range(self.count):
            self.dev.memset(int(self.buf.ptr), 0, self.nbytes)

    def close(self) -> None:
        self.dev.synchronize()
        self.buf.free()


def section_step(dev, gpu: bool, reps: int, warmup: int, full: bool) -> None:
    sync = dev.synchronize
    step = inputs.StepCase(dev, inputs.step_counts("8x128", gpu or full))
    tracer = gate = None
    res = RESULTS["step"]
    modes = ("batched", "per_stream")
    try:
        for _ in range(warmup):
            for m in modes:
                step.run(m)
                sync()
        ring = staging.staging_ring(step.arena)
        waits0 = ring.waits
        inter = plain(step, modes, reps, sync)
        ring_waits = (ring.waits - waits0) / (2 * reps)
        alone = {m: plain(step, (m,), reps, sync)[m] for m in modes}
        for m in modes:
            res[m] = {"counts": step.counts, "plain_interleaved": inter[m], "plain_alone": alone[m]}
        res["per_stream"]["staging_ring_waits_per_pass"] = ring_waits
        for m in modes:
            res[m]["phases_us"] = host_phases(step, m, reps, sync)
        tracer = Tracer(dev, 256)
        tracer.install()
        gate = Gate(dev, gpu)
        for m in modes:
            res[m]["ungated"] = traced(step, m, reps, sync, tracer)
        arena = step.arena
        old_ring = arena._attachments.get("ring:staging")
        big = PinnedRing(dev, 2 * len(step.counts) + 4, "staging (breakdown, gated)")
        arena._attachments["ring:staging"] = big
        try:
            for m in modes:
                gate.size_for(2.0 * res[m]["ungated"]["host_us"] + 300.0)
                res[m]["gate_us"] = gate.count * gate.us_per_memset
                res[m]["gated"] = traced(step, m, reps, sync, tracer, gate=gate)
        finally:
            sync()
            if old_ring is not None:
                arena._attachments["ring:staging"] = old_ring
            else:
                del arena._attachments["ring:staging"]
            big.close()
        for m in modes:
            print_step(m, res[m], gpu)
    finally:
        sync()
        if tracer is not None:
            tracer.close()
        if gate is not None:
            gate.close()
        step.close()


def print_step(mode: str, r: dict, gpu: bool) -> None:
    un, ga = r["ungated"], r["gated"]
    n = len(r["counts"])
    print(f"\n== step {n}x{r['counts'][0]} {mode}: plain host {fmt(r['plain_interleaved']['host_us'])} us, round trip "
          f"{fmt(r['plain_interleaved']['round_trip_us'])} (interleaved with the other mode, as gpu_compare); alone "
          f"{fmt(r['plain_alone']['host_us'])} / {fmt(r['plain_alone']['round_trip_us'])}")
    if "staging_ring_waits_per_pass" in r:
        print(f"   staging ring waits per pass (plain): {r['staging_ring_waits_per_pass']:.2f}")
    print("   host phases (us, wrappers installed):")
    ph = r["phases_us"]
    for top in PHASE_ORDER:
        order = [ph for _, _, ph in HOOKS] + [top + ": other"]
        items = sorted(((k, v) for k, v in ph.items() if k.startswith(top + ":") and not k.endswith("total")),
                       key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        print(f"     {top + ': total':<38} {fmt(ph.get(top + ': total')):>9}")
        for k, v in items:
            print(f"       {k:<36} {fmt(v):>9}")
    print(f"     {'pass: total':<38} {fmt(ph.get('pass: total')):>9}")
    held = f"{ga['held']}/{ga['reps']}" if gpu else "n/a (emulator)"
    print(f"   ops in order (gated: behind a {fmt(r['gate_us'])} us memset gate, held {held}; "
          f"ungated: after a sync, instrumented host {fmt(un['host_us'])} us, round trip {fmt(un['round_trip_us'])}):")
    print(f"     {'#':>3} {'op':<44} {'GPU us (gated)':>14} {'host done at':>13} {'device done at':>15} {'lag':>8}")
    gops = {i: o for i, o in enumerate(ga["ops"])}
    for i, o in enumerate(un["ops"]):
        g = gops.get(i)
        gdt = g["device_dt_us"] if g is not None and g["op"] == o["op"] else float("nan")
        print(f"     {i + 1:>3} {o['op'][:44]:<44} {fmt(gdt):>14} {fmt(o['host_at_us']):>13} {fmt(o['device_at_us']):>15} "
              f"{fmt(o['device_at_us'] - o['host_at_us']):>8}")
    total = sum(o["device_dt_us"] for o in ga["ops"])
    by_kernel = collections.defaultdict(float)
    for o in ga["ops"]:
        op = o["op"]
        by_kernel["H2D copies" if op.startswith("H2D") else "memsets" if op.startswith("memset") else op.split(" ")[0]] \
            += o["device_dt_us"]
    r["gpu_sum_us"] = total
    r["gpu_by_kernel_us"] = dict(by_kernel)
    print(f"   GPU time of the pass (gated sum): {fmt(total)} us; by kernel: "
          + ", ".join(f"{k} {fmt(v)} ({v / total:.0%})" for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1]))
          if total > 0 else "   GPU time of the pass: - (no device timing)")


# ----------------------------------------------------------------------------- staging
def section_staging(dev, gpu: bool, reps: int, warmup: int, full: bool) -> None:
    sync = dev.synchronize
    case = inputs.StagingCase(dev, 8, 2048 if gpu or full else 256)
    res = RESULTS["staging"]
    try:
        case.planned()
        sync()
        plan = case.plan
        chunk = max(case.counts)
        grid = plan._grids.get(chunk) or expand.geometry(case.n, chunk)[0]
        bound = plan._fires.get(chunk) or plan._fire(chunk)
        raw = inputs.raw_launcher(dev, plan._launch, grid, (expand.THREADS, 1, 1))
        paths = {
            "arena.reset + plan.stage": case.planned,
            "plan's bound launch (Launch.bind)": bound,
            "raw cuLaunchKernel, plan's args": raw,
            f"bare cuMemcpyHtoDAsync {case.staged_bytes:,} B": case.bare,
        }
        direct = inputs.ctypes_launcher(dev, plan._launch, grid, (expand.THREADS, 1, 1))
        if direct is not None:   # libcuda's cuLaunchKernel without the bindings (the GPU only)
            if direct() != 0:
                raise RuntimeError("cuLaunchKernel through ctypes failed")
            paths["ctypes libcuda cuLaunchKernel, plan's args"] = direct
        for fn in paths.values():
            for _ in range(warmup):
                fn()
            sync()
        out = {name: {} for name in paths}
        group = 10
        for name, fn in paths.items():
            # (a) back to back: groups of `group` + 1 calls, the first after each sync not counted
            xs = []
            while len(xs) < reps:
                sync()
                fn()
                for _ in range(group):
                    t0 = pc()
                    fn()
                    xs.append((pc() - t0) * 1e6)
            out[name]["back_to_back"] = med(xs)
            # (b) right after a sync that waited for the previous call's work; (c) the same with a 200 us
            # busy-wait between the sync and the call
            out[name]["after_sync"] = med(after_sync(fn, reps, sync, 0))
            out[name]["after_sync_spin200"] = med(after_sync(fn, reps, sync, 200))
        # (d) as gpu_compare's staging section: interleaved, an idle-stream sync before the call
        for name, t in host_and_round_trip(paths, reps, sync, warmup=0).items():
            out[name]["interleaved"] = t["host_us"]
            out[name]["interleaved_round_trip"] = t["round_trip_us"]
        # each one's device time (events around one call, and around 8 back to back)
        for name, fn in paths.items():
            out[name]["gpu_us"] = q12_events_us(dev, fn, max(20, reps // 4), warmup=3, batch=1)
            out[name]["gpu_us_batch8"] = q12_events_us(dev, fn, max(20, reps // 4), warmup=3, batch=8)
        ok = case.check()
        res.update({"n": case.n, "tokens": case.tokens, "staged_bytes": case.staged_bytes, "paths": out,
                    "arena_bytes_ok": ok})
        print(f"\n== staging {case.n}x{case.tokens} MRoPE ({case.staged_bytes:,} staged bytes): host time of one call, us "
              f"(median of {reps}); arena bytes {'ok' if ok else 'WRONG'}")
        cols = ("back_to_back", "after_sync", "after_sync_spin200", "interleaved", "interleaved_round_trip", "gpu_us",
                "gpu_us_batch8")
        heads = ("(a) b2b", "(b) sync", "(c) +spin", "(d) inter", "(d) RT", "GPU 1", "GPU 8")
        print(f"   {'path':<40}" + "".join(f"{h:>11}" for h in heads))
        for name, r in out.items():
            print(f"   {name[:40]:<40}" + "".join(f"{fmt(r[c]):>11}" for c in cols))
    finally:
        sync()
        case.close()


def section_floors(dev, gpu: bool, reps: int) -> None:
    sync = dev.synchronize
    launch = inputs.bench_launch(dev, "empty")
    fire = launch.bind((1, 1, 1), (32, 1, 1))
    idle, rt = [], []
    for _ in range(20):
        fire()
        sync()
    for _ in range(reps):
        sync()
        t0 = pc()
        sync()
        idle.append((pc() - t0) * 1e6)
        t0 = pc()
        fire()
        sync()
        rt.append((pc() - t0) * 1e6)
    RESULTS["floors"] = {"sync_idle_us": med(idle), "empty_launch_round_trip_us": med(rt)}


# ----------------------------------------------------------------------------- the table
def print_table() -> None:
    meta = RESULTS["meta"]
    print(f"\n== breakdown: {meta.get('device')} ({meta.get('driver')}), {meta.get('date_utc')}, commit "
          f"{meta.get('commit')}{' (dirty)' if meta.get('dirty') else ''}, {meta.get('reps')} reps")
    for name, err in RESULTS["errors"].items():
        print(f"   error in {name}: {err.splitlines()[0][:160]}")
    fl = RESULTS.get("floors") or {}
    if fl:
        print(f"floors: sync on an idle stream {fmt(fl['sync_idle_us'])} us; empty launch + sync "
              f"{fmt(fl['empty_launch_round_trip_us'])} us")
    st = RESULTS.get("step") or {}
    if st.get("batched", {}).get("gated"):
        print(f"{'step':<22} {'RT':>8} {'host':>8} {'GPU sum':>8} {'dev end':>8} {'RT-max':>8}  verdict, top kernel")
        for m in ("batched", "per_stream"):
            r = st.get(m)
            if not r or "gpu_sum_us" not in r:
                continue
            rtt, host, gsum = r["plain_interleaved"]["round_trip_us"], r["plain_interleaved"]["host_us"], r["gpu_sum_us"]
            top = max(r["gpu_by_kernel_us"].items(), key=lambda kv: kv[1]) if r["gpu_by_kernel_us"] else ("-", 0.0)
            verdict = "GPU-bound" if gsum > host else "host-bound"
            share = f"{top[1] / gsum:.0%}" if gsum > 0 else "-"
            print(f"{m:<22} {fmt(rtt):>8} {fmt(host):>8} {fmt(gsum):>8} {fmt(r['ungated']['device_end_us']):>8} "
                  f"{fmt(rtt - max(host, gsum)):>8}  {verdict}; {top[0]} {fmt(top[1])} ({share})")
        print("  RT/host: plain, interleaved; GPU sum: gated op times; dev end: last op done, ungated, event clock "
              "from the pass's start; RT-max = RT - max(host, GPU sum)")
    sg = (RESULTS.get("staging") or {}).get("paths")
    if sg:
        print(f"{'staging host time':<40} {'b2b':>7} {'sync':>7} {'+spin':>7} {'inter':>7} {'GPU':>7}")
        for name, r in sg.items():
            print(f"{name[:40]:<40} {fmt(r['back_to_back']):>7} {fmt(r['after_sync']):>7} "
                  f"{fmt(r['after_sync_spin200']):>7} {fmt(r['interleaved']):>7} {fmt(r['gpu_us']):>7}")
    print("times in us, medians")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", default=os.environ.get("Q12DRV_DRIVER") or "auto", help="cuda, emu or auto (default)")
    ap.add_argument("--reps", type=int, default=200, help="repetitions per median (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    ap.add_argument("--sections", default="step,staging", help="comma-separated subset of: step, staging")
    ap.add_argument("--stub", action="store_true",
                    help="emulator only: no-op copies and launches (host paths only, at the GPU's shapes)")
    ap.add_argument("--out", help="write every measurement as JSON here")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(sections) - {"step", "staging"}
    if bad:
        ap.error(f"unknown sections: {', '.join(sorted(bad))}")
    t_start = pc()
    dev = q12drv.open_device(args.driver)
    gpu = inputs.on_gpu(dev)
    if args.stub:
        if gpu:
            ap.error("--stub replaces the emulated driver's work; it cannot stub a real GPU")
        inputs.stub_driver(dev)
    RESULTS["meta"] = {**report.environment(dev), "reps": args.reps, "stub": args.stub}
    print(f"device: {dev.name} ({dev.driver.name}){' with copies and launches stubbed' if args.stub else ''}",
          flush=True)
    try:
        try:
            section_floors(dev, gpu, args.reps)
        except Exception as exc:  # noqa: BLE001 - a diagnostic reports and goes on
            RESULTS["errors"]["floors"] = report.section_error(exc)
        for name in sections:
            fn = {"step": section_step, "staging": section_staging}[name]
            report.run_section(RESULTS, name, lambda: fn(dev, gpu, args.reps, args.warmup, args.stub), dev)
    finally:
        report.finish_run(RESULTS, t_start, args.out, print_table, dev)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
