"""The ``q12drv`` command."""

from __future__ import annotations

import argparse
import os
import sys

from .._version import __version__
from .dump_cli import COMMANDS, ExampleFormatter, failure_status

__all__ = ["main"]

_DRIVER_HELP = ("which driver: 'auto' uses the GPU when there is one and the emulator otherwise, "
                "'cuda' insists on the GPU, 'emu' always emulates (default: $Q12DRV_DRIVER or auto)")


def _cmd_demo(args) -> int:
    from .demo import DemoConfig, run_demo
    from ..core.device import open_device
    from ..core.errors import Q12Error

    if args.dump is not None:  # refuse before the run, not after it
        parent = os.path.dirname(os.path.abspath(args.dump))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(args.dump):
            raise Q12Error(f"cannot write the dump {args.dump}: {parent} is not a writable directory"
                           if not os.path.isdir(args.dump) else f"cannot write the dump {args.dump}: it is a directory")

    with open_device(args.driver) as dev:
        ok = run_demo(dev, DemoConfig(seed=args.seed), kernels=not args.no_kernels, dump=args.dump)
    return 0 if ok else 1


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor(args.driver, arch=args.arch)


def _cmd_build(args) -> int:
    from .build import build_cache

    return build_cache(args.arch)


def _cmd_sass(args) -> int:
    from .sass import run_sass

    return run_sass(args.source, tuple(args.entry), arch=args.arch, summary_only=args.summary)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="q12drv",
        formatter_class=ExampleFormatter,
        description="Stage batched (Q12) prefill metadata into a CUDA arena and run the kernels that read it. "
                    "Every command works without a GPU (on the emulated driver); 'q12drv COMMAND --help' says "
                    "what a command does and shows an example.",
        epilog="examples:\n"
               "  q12drv demo                 # one whole batched pass, verified\n"
               "  q12drv doctor               # driver, device, NVRTC; every kernel compiled\n"
               "  q12drv build                # every kernel into the cubin cache, ahead of the first pass\n"
               "  q12drv sass kv_write.cu     # a kernel's machine code\n"
               "  q12drv demo --dump a.npz    # then 'q12drv inspect a.npz': inside the arena",
    )
    p.add_argument("--version", action="version", version=f"q12drv {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    d = sub.add_parser("demo", help="plan, admit, stage and verify one batched pass (and run its kernels)",
                       formatter_class=ExampleFormatter,
                       description="Plan 8 ragged prefill streams (Qwen3-Next-like, MRoPE), decide admission, stage "
                                   "the metadata with one pinned copy, place the h_state_ptrs slot, read the arena "
                                   "back and verify every field; then run one attention and one Gated DeltaNet layer "
                                   "batched and per stream and compare them bit for bit. Exit status 1 if a check fails.",
                       epilog="examples:\n"
                              "  q12drv demo                             # on the GPU if there is one, else emulated\n"
                              "  q12drv demo --driver emu --no-kernels   # staging only, on the emulator\n"
                              "  q12drv demo --dump a.npz                # then: q12drv inspect a.npz")
    d.add_argument("--driver", default="auto", choices=["auto", "cuda", "emu"], help=_DRIVER_HELP)
    d.add_argument("--seed", type=int, default=0, help="random seed for block tables and activations (default 0)")
    d.add_argument("--no-kernels", action="store_true", help="stop after staging (skip the attention and GDN layers)")
    d.add_argument("--dump", metavar="PATH", default=None,
                   help="write an arena dump (.npz) of the staged batched pass to PATH (see 'q12drv inspect')")
    d.set_defaults(func=_cmd_demo)
    doc = sub.add_parser("doctor", help="print driver, device, NVRTC and compile every kernel",
                         formatter_class=ExampleFormatter,
                         description="Print the driver, the device, the NVRTC version and header directory, then "
                                     "compile every kernel in cuda_src/ as q12drv builds it and print, per kernel, "
                                     "registers, spills, stack, static and dynamic shared memory, the compile time "
                                     "and (with nvdisasm, in the test extra) its SASS instruction count and "
                                     "warpgroup MMAs. Works without a GPU (compile only). Exit status 1 if a kernel "
                                     "fails to compile, spills or has its warpgroup MMAs serialised.",
                         epilog="examples:\n"
                                "  q12drv doctor                # this machine, for its GPU's architecture\n"
                                "  q12drv doctor --driver emu   # for sm_90 (the H200), without touching a GPU")
    doc.add_argument("--driver", default="auto", choices=["auto", "cuda", "emu"], help=_DRIVER_HELP)
    doc.add_argument("--arch", default=None,
                     help="compile target, e.g. sm_90 (default: the device's, sm_90 without a GPU); the wgmma "
                          "sources are skipped on targets other than Hopper's")
    doc.set_defaults(func=_cmd_doctor)
    bu = sub.add_parser("build", help="compile every kernel into the cubin cache ahead of the first pass",
                        formatter_class=ExampleFormatter,
                        description="Compile every kernel source for one architecture into the on-disk cubin cache "
                                    "($Q12DRV_CACHE_DIR, default ~/.cache/q12drv/cubin) exactly as a launch looks it "
                                    "up, so a runtime's first pass does not spend NVRTC's seconds per source. Works "
                                    "without a GPU: build on the machine (or image) the runtime will use, for its "
                                    "GPU's architecture.",
                        epilog="examples:\n"
                               "  q12drv build                 # for the H200 (sm_90)\n"
                               "  Q12DRV_CACHE_DIR=/opt/q12drv-cubin q12drv build --arch sm_90   # into an image")
    bu.add_argument("--arch", default="sm_90", help="the GPU's architecture (default sm_90, the H200's)")
    bu.set_defaults(func=_cmd_build)
    sa = sub.add_parser("sass", help="print a kernel's machine code (nvdisasm) and count its warpgroup MMAs",
                        formatter_class=ExampleFormatter,
                        description="Compile one cuda_src/ source as q12drv builds it and print the SASS of its "
                                    "entries, each with its instruction count and its warpgroup MMAs (HGMMA) and "
                                    "the groups they form: a build whose every MMA is its own group was serialised "
                                    "by ptxas (NVRTC's log does not say so). Needs nvdisasm (the "
                                    "nvidia-cuda-nvdisasm wheel, in the test extra). Works without a GPU. Exit status "
                                    "1 if an entry's MMAs are serialised.",
                        epilog="examples:\n"
                               "  q12drv sass kv_write.cu                     # every entry's SASS\n"
                               "  q12drv sass gdn/chunked_wgmma.cu --summary  # one line per entry: the counts\n"
                               "  q12drv sass attention/wgmma.cu q12_attn_wgmma_d128 | less")
    sa.add_argument("source", help="a file in cuda_src/, e.g. gdn/chunked_wgmma.cu (an unknown name lists them)")
    sa.add_argument("entry", nargs="*", help="entries to print (default: all of the source's)")
    sa.add_argument("--arch", default="sm_90", help="compile target (default sm_90; wgmma sources build for sm_90a)")
    sa.add_argument("--summary", action="store_true", help="only the counts, one line per entry")
    sa.set_defaults(func=_cmd_sass)
    for name, (help_, description, example, add, run) in COMMANDS.items():
        c = sub.add_parser(name, help=help_, description=description, epilog=example,
                           formatter_class=ExampleFormatter)
        add(c)
        c.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (q12drv sass ... | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (Exception, KeyboardInterrupt) as exc:  # one line on stderr and exit status 2, never a traceback
        return failure_status(f"q12drv {args.command}", exc)


if __name__ == "__main__":
    sys.exit(main())
