"""Kernel device times through pytest-benchmark: each op of a batched pass alone, so ``--benchmark-compare`` covers
the kernels as well as the host path.

The timer is :class:`bench.timing.DeviceClock`: a round's time is the device time between two events around
:data:`bench.timing.BATCH` calls back to back (divided by it), so the host's work for a call overlaps the device's
work for the one before and is not counted. Inside the timed region: the op's launches only (the pass is staged
before). The batch is Qwen3-Next-like (``bench.inputs.QWEN3_NEXT``), eight ragged streams of 256..2048 tokens
(9,216 in all). Attention's, the GDN layer's and the convolution's inputs exceed the H200's 50 MiB L2 (Q alone is
75 MB, the convolution's input 151 MB), so each call reads them from HBM; the KV write's (about 38 MB) and RoPE's
(about 21 MB, in place) fit in it, so their times here are warm-L2 times (``gpu_compare``'s ``kv_write`` and ``rope``
sections rotate inputs past L2 and compare with the byte floor). On the emulator the streams are cut down to 4..32 tokens and the times are the
numpy emulation's (labelled ``driver: emu``): a plumbing check, not a measurement.
"""

import pytest

from bench.inputs import CONV_CHANNELS, CONV_WIDTH, StepCase, conv1d_inputs, on_gpu, step_counts
from bench.timing import DeviceClock

CLOCK = DeviceClock()
pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True)
OPS = ("rope", "kv_write", "attention", "attention_layer", "conv1d", "gdn_layer")


@pytest.fixture(scope="module")
def case(dev):
    """The step case, its pass (staged once, batched) and the short convolution's inputs."""
    step = StepCase(dev, step_counts("ragged", on_gpu(dev)))
    bufs: list = []
    conv = conv1d_inputs(dev, step.counts, bufs)
    n = len(step.counts)
    conv["ptr_list"] = [int(conv["states"].ptr) + b * (CONV_WIDTH - 1) * CONV_CHANNELS * 2 for b in range(n)]
    q12 = step.run("batched")  # stages the pass (and runs each layer once: kernels loaded, pools written)
    dev.synchronize()
    yield step, q12, conv
    dev.synchronize()
    CLOCK.close()
    for buf in bufs:
        buf.free()
    step.close()


def _op(step, q12, conv, name):
    p, att, nb = step.ptrs, step.att, step.num_blocks
    if name == "rope":
        return lambda: q12.rope(p["q"], p["k"], att)
    if name == "kv_write":
        return lambda: q12.kv_write(p["k"], p["v"], p["k_pool"], p["v_pool"], att, num_blocks=nb)
    if name == "attention":
        return lambda: q12.attention(p["q"], p["k_pool"], p["v_pool"], p["o"], att, num_blocks=nb)
    if name == "attention_layer":
        return lambda: q12.attention_layer(p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], att,
                                           num_blocks=nb)
    if name == "conv1d":
        x, y, w = (int(conv[k].ptr) for k in ("x", "y", "w"))
        return lambda: q12.conv1d(conv["ptr_list"], x, y, w, channels=CONV_CHANNELS, width=CONV_WIDTH)
    kw = step.gdn_kwargs()
    return lambda: q12.gdn_layer(step.state_ptrs, step.gdn_tensors, step.gdn, **kw)


@pytest.mark.parametrize("op", OPS)
def test_kernel_device_time(benchmark, dev, case, op):
    step, q12, conv = case
    benchmark.group = "kernel device time (ragged 8 x 256..2048)"
    benchmark.extra_info.update(driver=dev.driver.name, counts=step.counts, timer="device (events)")
    benchmark.pedantic(CLOCK.timed(dev, _op(step, q12, conv, op)), setup=dev.synchronize,
                       rounds=30 if on_gpu(dev) else 1, iterations=1, warmup_rounds=2 if on_gpu(dev) else 0)
