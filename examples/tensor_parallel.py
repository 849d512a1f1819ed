"""Tensor parallelism with q12drv: one arena per device, the batch staged once on the host, one copy per device.

Every rank of a tensor-parallel group runs the same tokens over its own share of the attention heads: its own Q, K
and V rows, its own KV-cache pools (the same block ids on every rank), its own arena, its own stream. The prefill
metadata (positions, KV slots, prefix sums) is the same for every rank but for the addresses of each rank's copy of
the block tables, so :func:`q12drv.core.staging.stage_replicated` validates and packs it once on the host and copies
it to each device with that device's table pointers. Each :class:`q12drv.Device` keeps its own context current for
its own calls, so one thread can drive every rank, as here (a thread per rank works as well).

The example checks that the heads each rank computed equal the same heads of one device running all of them.

    python examples/tensor_parallel.py                 # every GPU there is (1 included), or the emulator's two
    python examples/tensor_parallel.py --driver emu    # two emulated devices, no GPU needed
    python examples/tensor_parallel.py --devices 2     # the first two GPUs
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import q12drv
from q12drv import ScratchArena, StreamStageInfo, make_scratch_plan
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.core.driver import open_driver
from q12drv.core.staging import stage_replicated
from q12drv.kernels import ops

BLOCK = 16
COUNTS, STARTS = [37, 64, 5], [0, 16, 100]
Q_HEADS, KV_HEADS, HEAD_DIM = 2, 1, 128  # per rank


def upload_tables(dev, tables: list, kv_lens: list) -> tuple:
    """One device's copy of the block tables and the ``seq_len`` words: ``(buffer, StreamStageInfo list)``."""
    cap = max(t.size for t in tables)
    buf = dev.alloc(len(tables) * (cap * 4 + 8), "block tables")
    streams = []
    for b, (table, start, count) in enumerate(zip(tables, STARTS, COUNTS)):
        table_dev = int(buf.ptr) + b * cap * 4
        seq_len_dev = int(buf.ptr) + len(tables) * cap * 4 + 8 * b
        dev.upload(table_dev, table)
        dev.upload(seq_len_dev, np.array([kv_lens[b]], np.uint32))
        streams.append(StreamStageInfo(start, count, table, table_dev, seq_len_dev))
    return buf, streams


def attention(dev, meta, host: dict, hq: int, hkv: int, num_blocks: int, stream) -> np.ndarray:
    """RoPE, KV write and attention of ``host``'s heads on ``dev``; the output, bf16 bits ``[T, hq, D]``."""
    bufs = {k: dev.alloc(a.nbytes, k) for k, a in host.items()}
    try:
        for k, a in host.items():
            dev.upload(bufs[k].ptr, a, stream)
        p = {k: int(b.ptr) for k, b in bufs.items()}
        ops.rope(dev, meta, p["q"], p["k"], num_q_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, rotary_dim=HEAD_DIM,
                 theta=1e6, stream=stream)
        ops.kv_write(dev, meta, p["k"], p["v"], p["k_pool"], p["v_pool"], num_kv_heads=hkv, head_dim=HEAD_DIM,
                     num_blocks=num_blocks, stream=stream)
        ops.attention(dev, meta, p["q"], p["k_pool"], p["v_pool"], p["o"], num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=HEAD_DIM, stream=stream)
        return dev.download_array(p["o"], np.uint16, host["o"].shape, stream)
    finally:
        for b in bufs.values():
            b.free()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", default="auto", choices=("auto", "cuda", "emu"))
    parser.add_argument("--devices", type=int, default=None, help="ranks (default: every device there is)")
    args = parser.parse_args(argv)

    driver = open_driver(args.driver)
    ranks = args.devices or driver.device_count()
    devices = [q12drv.open_device(driver, r) for r in range(ranks)]  # one driver: one machine's devices
    rng = np.random.default_rng(0)
    t = sum(COUNTS)
    kv_lens = [s + c for s, c in zip(STARTS, COUNTS)]
    need = [-(-k // BLOCK) for k in kv_lens]
    num_blocks = sum(need) + 1
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    tables = [np.array([next(ids) for _ in range(k)], np.int32) for k in need]  # the scheduler's, shared by all ranks
    bf = lambda *shape: to_bf16_bits(rng.standard_normal(shape))  # noqa: E731
    full = {"q": bf(t, ranks * Q_HEADS, HEAD_DIM), "k": bf(t, ranks * KV_HEADS, HEAD_DIM),
            "v": bf(t, ranks * KV_HEADS, HEAD_DIM), "k_pool": bf(num_blocks, BLOCK, ranks * KV_HEADS, HEAD_DIM),
            "v_pool": bf(num_blocks, BLOCK, ranks * KV_HEADS, HEAD_DIM),
            "o": np.zeros((t, ranks * Q_HEADS, HEAD_DIM), np.uint16)}

    def shard(r: int) -> dict:  # rank r's heads: Q heads [r*Q_HEADS, ...), KV heads [r*KV_HEADS, ...)
        q, kv = slice(r * Q_HEADS, (r + 1) * Q_HEADS), slice(r * KV_HEADS, (r + 1) * KV_HEADS)
        return {k: np.ascontiguousarray(a[..., q, :] if k in ("q", "o") else a[..., kv, :]) for k, a in full.items()}

    plan = make_scratch_plan(COUNTS, 0, False)
    owned = []
    try:
        uploaded = [upload_tables(dev, tables, kv_lens) for dev in devices]
        owned += [buf for buf, _ in uploaded]
        arenas = [ScratchArena(dev, plan.staged_bytes) for dev in devices]
        owned += arenas
        streams = [dev.new_stream() for dev in devices]
        metas = stage_replicated(arenas, [s for _, s in uploaded], block_size=BLOCK, use_mrope=False,
                                 scratch_offset_bytes=0, dummy_kv_block=0, stream=streams)
        outs = [attention(dev, metas[r], shard(r), Q_HEADS, KV_HEADS, num_blocks, streams[r])
                for r, dev in enumerate(devices)]
        # the reference: device 0 alone, every head
        with ScratchArena(devices[0], plan.staged_bytes) as arena:
            meta = stage_replicated([arena], [uploaded[0][1]], block_size=BLOCK, use_mrope=False,
                                    scratch_offset_bytes=0, dummy_kv_block=0)[0]
            whole = attention(devices[0], meta, full, ranks * Q_HEADS, ranks * KV_HEADS, num_blocks, None)
        got = np.concatenate(outs, axis=1)
        diff = np.abs(from_bf16_bits(got) - from_bf16_bits(whole)).max()
        result = {"ranks": ranks, "driver": driver.name, "devices": [d.name for d in devices],
                  "max_abs_diff": float(diff), "identical": bool(np.array_equal(got, whole))}
    finally:
        for obj in reversed(owned):
            (getattr(obj, "close", None) or obj.free)()
        for dev in devices:
            dev.close()
    print(f"{ranks} rank(s) on {result['driver']} ({', '.join(result['devices'])}): each rank's heads "
          f"{'equal' if result['identical'] else 'differ from'} one device's run of all of them "
          f"(max |difference| {result['max_abs_diff']:.3g})")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["max_abs_diff"] <= 1e-2 else 1)
