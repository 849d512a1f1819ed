# temporary benchmark (not part of the deliverable)
import ctypes, os, shutil, sys, tempfile, re
import numpy as np
sys.path.insert(0, os.getcwd())
LOCAL = os.environ.get("LOCAL_BUILD")
if not LOCAL:
    import torch
    torch.zeros(1, device="cuda")
from cuda.bindings import driver as cu
from q12drv.kernels import attention as attn
from q12drv.kernels.meta import Q12MetaC, meta_defines
from q12drv.nvrtc import compile_source
if not LOCAL:
    from tests.gpu.test_attention_gpu import Case, _ok
SRC = open("cuda_src/attn_prefill.cu").read()
def build_local(name, variant_subs):
    d = tempfile.mkdtemp()
    shutil.copy("cuda_src/q12_meta.cuh", d)
    s = SRC
    for a, b in variant_subs:
        assert a in s, a
        s = s.replace(a, b)
    open(os.path.join(d, "attn_prefill.cu"), "w").write(s)
    os.environ["Q12DRV_CUDA_SRC"] = d
    img = compile_source("attn_prefill.cu", defines=meta_defines(), use_cache=False, verbose_resources=True)
    del os.environ["Q12DRV_CUDA_SRC"]
    regs = re.findall(r"Used (\d+) registers", img.log)
    open(f".attn_whl/{name}.cubin", "wb").write(img.image)
    sp = re.findall(r"(\d+) bytes spill stores", img.log)
    open(f".attn_whl/{name}.regs", "w").write(" ".join(regs) + " spills " + " ".join(sp))

def build(name):
    mod = _ok(cu.cuModuleLoadData(open(f".attn_whl/{name}.cubin", "rb").read()))
    regs = open(f".attn_whl/{name}.regs").read()
    funcs = {}
    for dd, nm in attn.HEAD_DIMS.items():
        f = _ok(cu.cuModuleGetFunction(mod, nm.encode()))
        _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 227*1024))
        if not os.environ.get("NO_CARVE"):
            _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
        funcs[dd] = f
    return funcs, regs

def flops(c):
    tot = 0
    for ql, kv in zip(c.q_lens, c.kv_lens):
        ql, kv = int(ql), int(kv)
        tot += ql * (kv - ql) + ql * (ql + 1) // 2
    return 4 * c.d * c.hq * tot

def timeit(fn, iters=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e-3

def bench_case(funcs, c, smem_fn):
    keep = []
    n = len(c.q_lens)
    meta = c.meta(list(range(n)), keep)
    obuf = torch.empty(int(c.cu[-1]) * c.hq * c.d, dtype=torch.int16, device="cuda")
    grid, block, _ = attn.geometry(n, int(meta.chunk_len), c.hq, c.d)
    smem = smem_fn(c.d)
    params = [meta, ctypes.c_uint64(c.dq.data_ptr()), ctypes.c_uint64(c.dk.data_ptr()), ctypes.c_uint64(c.dv.data_ptr()),
              ctypes.c_uint64(obuf.data_ptr()), ctypes.c_int(c.hq), ctypes.c_int(c.hkv), ctypes.c_int(c.bs), ctypes.c_float(c.d ** -0.5)]
    argv = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
    st = cu.CUstream(torch.cuda.current_stream().cuda_stream)
    fn = lambda: _ok(cu.cuLaunchKernel(funcs[c.d], *grid, *block, smem, st, ctypes.addressof(argv), 0))
    t = timeit(fn)
    return t, flops(c) / t / 1e12

def sdpa_tflops(c):
    # fresh single-stream only: torch flash/cudnn causal on contiguous tensors
    S = int(c.q_lens[0]); kv = int(c.kv_lens[0])
    q = torch.randn(1, c.hq, S, c.d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, c.hkv, kv, c.d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    out = {}
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel([be]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                t = timeit(f)
            out[name] = round(flops(c) / t / 1e12, 1)
        except Exception as ex:
            out[name] = f"n/a {type(ex).__name__}"
    return out

rng = np.random.default_rng(0)
cases = {} if LOCAL else {
  "d128 fresh 8k Hq32/8 bs16": Case(rng, [8192], [0], hq=32, hkv=8, d=128, bs=16),
  "d128 4x2k Hq32/8 bs64": Case(rng, [2048]*4, [0]*4, hq=32, hkv=8, d=128, bs=64),
  "d128 chunk q2k kv8k Hq32/8": Case(rng, [2048], [6144], hq=32, hkv=8, d=128, bs=64),
  "d256 fresh 8k Hq16/2 bs16": Case(rng, [8192], [0], hq=16, hkv=2, d=256, bs=16),
  "d256 chunk q2k kv8k Hq16/2": Case(rng, [2048], [6144], hq=16, hkv=2, d=256, bs=64),
  "d64 fresh 8k Hq32/8": Case(rng, [8192], [0], hq=32, hkv=8, d=64, bs=16),
}
BASE = {64: (64, 8, 1, "true"), 128: (32, 4, 2, "false"), 256: (64, 8, 1, "false")}
variants = {"base": {}}
for v in os.environ.get("VARIANTS", "").split(";"):
    if not v: continue
    d, bn, nw, mw, qr = v.split(",")
    variants[v] = {int(d): (int(bn), int(nw), int(mw), qr)}
for vn, ch in variants.items():
    cfg = dict(BASE); cfg.update(ch)
    subs = []
    for d in ch:
        o = BASE[d]
        subs.append((f"attn_prefill<{d}, {o[0]}, {o[1]}, {o[2]}, {o[3]}>", "attn_prefill<{}, {}, {}, {}, {}>".format(d, *ch[d])))
    for d, (bn, nw, mw, qr) in cfg.items():
        attn.BLOCK_N[d] = bn; attn.WARPS[d] = nw; attn.THREADS[d] = 32 * nw; attn.BLOCK_M[d] = 16 * nw * mw
    vname = re.sub(r"[^0-9a-z]", "_", vn)
    if LOCAL:
        build_local(vname, subs); continue
    funcs, regs = build(vname)
    print("variant", vn, "regs d256,d128,d64:", regs, flush=True)
    for cn, c in cases.items():
        if ch and c.d not in ch: continue
        if os.environ.get("ONLY") and os.environ["ONLY"] not in cn: continue
        t, tf = bench_case(funcs, c, attn.smem_bytes)
        print(f"  {cn:32s} {t*1e3:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
for cn, c in cases.items():
    if "fresh" in cn and not os.environ.get("NO_SDPA"): print("sdpa", cn, sdpa_tflops(c), flush=True)
