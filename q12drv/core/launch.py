"""Modules, kernels and launches with arguments packed once and updated in place.

A kernel's parameter types come from its ``extern "C" __global__`` declaration in
``cuda_src`` (never guessed from Python values): :func:`parse_signatures` maps each parameter to
a ctypes type, :class:`Launch` lays them out in one ctypes structure plus the ``void*[]`` array
``cuLaunchKernel`` wants, both built once. Each launch only rewrites the fields that changed.
"""

from __future__ import annotations

import ctypes
import operator
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from .device import CURRENT, Device, Stream
from .driver import EmuImage
from .nvrtc import compile_source, cuda_src_dir, local_headers

__all__ = ["parse_signatures", "load_module", "Module", "Kernel", "Launch"]

# __launch_bounds__ arguments may hold one level of parentheses, e.g. ((WG + 1) * 128, 1)
_BOUNDS = r'(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
_ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+' + _BOUNDS + r'void\s+' + _BOUNDS + r'(\w+)\s*\(([^)]*)\)',
                       re.MULTILINE)
#: ``#define NAME text`` (backslash continuations included): a parameter list written once and named by its
#: macro in every entry that takes it (``extern "C" __global__ void e_d128(GDN_PARAMS) {...}``).
_DEFINE_RE = re.compile(r'^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+((?:[^\n\\]|\\\n|\\)*)$', re.MULTILINE)
_QUALIFIERS = {"const", "__restrict__", "__grid_constant__", "volatile"}
_SCALARS = {
    "int": ctypes.c_int32,
    "signed int": ctypes.c_int32,
    "unsigned int": ctypes.c_uint32,
    "unsigned": ctypes.c_uint32,
    "long long": ctypes.c_int64,
    "long long int": ctypes.c_int64,
    "unsigned long long": ctypes.c_uint64,
    "unsigned long long int": ctypes.c_uint64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_INT_RANGES = {
    ctypes.c_int32: (-(1 << 31), (1 << 31) - 1),
    ctypes.c_uint32: (0, (1 << 32) - 1),
    ctypes.c_int64: (-(1 << 63), (1 << 63) - 1),
    ctypes.c_uint64: (0, (1 << 64) - 1),
}


def _dim3(what: str, dims) -> tuple:
    try:
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        out = ()
    if len(out) != 3 or min(out) < 1:
        raise ValueError(f"{what} must be three positive ints (x, y, z), got {dims!r}")
    return out


def parse_signatures(source: str, struct_types: Mapping[str, type] | None = None,
                     headers: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Parameter lists of every ``extern "C" __global__`` entry in ``source``.

    An entry whose parameter list is one macro name (``void e(GDN_PARAMS)``) takes that macro's text, from
    ``source`` or ``headers``: a family of entries declares its parameters once.

    Parameters
    ----------
    source : str
        CUDA C++ source text.
    struct_types : mapping of str to ctypes.Structure subclass
        By-value struct parameter types, e.g. ``{"Q12Meta": Q12MetaC}``.
    headers : tuple of str
        Text of the headers ``source`` includes (where its parameter-list macros may be defined).

    Returns
    -------
    dict
        entry name -> tuple of (parameter name, ctypes type); pointers are ``c_uint64``.

    Raises
    ------
    ValueError
        A parameter type that is not a pointer, a known scalar or a given struct.
    """
    structs = dict(struct_types or {})
    macros = {m: text.replace("\\\n", " ") for part in (*headers, source) for m, text in _DEFINE_RE.findall(part)}
    out: dict[str, tuple] = {}
    for name, plist in _ENTRY_RE.findall(source):
        plist = macros.get(plist.strip(), plist)
        params = []
        for raw in (p.strip() for p in plist.split(",")):
            if not raw:
                continue
            if "*" in raw:
                pname = raw.rsplit("*", 1)[1].split()[-1]
                params.append((pname, ctypes.c_uint64))
                continue
            words = [w for w in raw.split() if w not in _QUALIFIERS]
            ctype_name, pname = " ".join(words[:-1]), words[-1]
            if ctype_name in _SCALARS:
                params.append((pname, _SCALARS[ctype_name]))
            elif ctype_name in structs:
                params.append((pname, structs[ctype_name]))
            else:
                raise ValueError(f"kernel {name}: parameter {raw!r} has a type q12drv cannot pack ({ctype_name!r})")
        out[name] = tuple(params)
    return out


class Launch:
    """One kernel's arguments, packed once; ``set()`` updates fields in place, ``launch()`` enqueues.

    A launch's argument block belongs to one thread at a time (set, then launch): threads that launch the same
    kernel each use their own (:func:`q12drv.kernels.registry.prepared` keeps one per thread). Any thread may
    launch it; the device's context is made current there first (a thread-local check).

    ``fire(grid, block, smem, driver_stream)`` is the driver's launch call with this kernel and this argument block
    bound: :meth:`launch` without its checks, for a caller that made the context current, allowed ``smem`` and
    resolved the stream (:meth:`Device.as_stream <q12drv.core.device.Device.as_stream>`) already;
    :meth:`fire_dependent` likewise for :meth:`launch_dependent`.

    Examples
    --------
    >>> launch = kernel.prepare(n=4)              # doctest: +SKIP
    >>> launch.set(x=buf.ptr)                     # doctest: +SKIP
    >>> launch.launch((8, 1, 1), (128, 1, 1))    # doctest: +SKIP
    """

    __slots__ = ("kernel", "args", "_ptrs", "_addr", "_ranges", "_device", "fire", "_fire_dependent")

    def __init__(self, kernel: "Kernel"):
        self.kernel = kernel
        self.args = kernel.args_type()
        base = ctypes.addressof(self.args)
        offsets = [getattr(kernel.args_type, name).offset for name, _ in kernel.params]
        self._ptrs = (ctypes.c_void_p * max(1, len(offsets)))(*[base + off for off in offsets])
        self._addr = ctypes.addressof(self._ptrs)
        self._ranges = {name: _INT_RANGES.get(t) for name, t in kernel.params}
        self._device = kernel.device
        # the driver's launch call with this kernel and this argument block already bound
        self.fire = kernel.device.driver.launcher(kernel.func, self._addr)
        self._fire_dependent = None   # launch_dependent's, made on its first call (few kernels are launched so)

    def set(self, **values: Any) -> "Launch":
        """Write argument values by parameter name (checked against the parameter's C type)."""
        ranges, args = self._ranges, self.args
        for name, value in values.items():
            try:
                bounds = ranges[name]
            except KeyError:
                raise TypeError(f"kernel {self.kernel.name} has no parameter {name!r}; parameters: "
                                f"{', '.join(n for n, _ in self.kernel.params)}") from None
            if bounds is not None:
                if type(value) is not int:  # exact ints (the common case) need no conversion
                    try:
                        value = operator.index(value)  # ints and numpy ints; a float or a string is a caller bug
                    except TypeError:
                        raise TypeError(f"kernel {self.kernel.name}: {name} must be an int, got "
                                        f"{type(value).__name__} {value!r:.60}") from None
                if not bounds[0] <= value <= bounds[1]:
                    raise OverflowError(f"kernel {self.kernel.name}: {name}={value} does not fit its C type "
                                        f"(range {bounds[0]}..{bounds[1]})")
            setattr(args, name, value)
        return self

    def launch(self, grid: tuple, block: tuple, smem: int = 0, stream: Any = None) -> None:
        """Enqueue the kernel with the current arguments on ``stream`` (see ``Device.as_stream``).

        ``grid`` and ``block`` are 3-tuples. A q12drv :class:`~q12drv.core.device.Stream` (or None, the
        device's stream) is the fast case; anything else goes through ``Device.as_stream``.
        """
        dev = self._device
        if CURRENT.device is not dev:  # another thread, or another device's context current here
            dev.set_current()
        if smem and smem > self.kernel.smem_limit:
            self.kernel.allow_dynamic_smem(smem)
        if stream is None:
            self.fire(grid, block, smem, dev.stream.raw)
        elif type(stream) is Stream and stream.device is dev and stream.raw is not None:
            self.fire(grid, block, smem, stream.raw)
        else:
            self.fire(grid, block, smem, dev.as_stream(stream))

    def launch_dependent(self, grid: tuple, block: tuple, smem: int = 0, stream: Any = None) -> None:
        """:meth:`launch` with programmatic stream serialization (:meth:`q12drv.core.driver.base.Driver.launch_dependent`):
        the kernel may start before the stream's previous kernel completes, once every CTA of that kernel has
        executed ``griddepcontrol.launch_dependents``; it must then synchronize with that kernel itself (flags,
        ``griddepcontrol.wait``). The driver's launch configuration is kept between calls
        (:meth:`q12drv.core.driver.base.Driver.dependent_launcher`)."""
        dev = self._device
        if CURRENT.device is not dev:
            dev.set_current()
        if smem and smem > self.kernel.smem_limit:
            self.kernel.allow_dynamic_smem(smem)
        raw = dev.stream.raw if stream is None else (
            stream.raw if type(stream) is Stream and stream.device is dev and stream.raw is not None
            else dev.as_stream(stream))
        self.fire_dependent(grid, block, smem, raw)

    def fire_dependent(self, grid: tuple, block: tuple, smem: int, stream: Any) -> None:
        """:meth:`launch_dependent` on the driver stream ``stream`` without its checks (see :attr:`fire`)."""
        fire = self._fire_dependent
        if fire is None:
            fire = self._fire_dependent = self._device.driver.dependent_launcher(self.kernel.func, self._addr)
        fire(grid, block, smem, stream)

    def bind(self, grid: tuple, block: tuple, smem: int = 0, stream: Any = None) -> Callable[[], None]:
        """A zero-argument callable that enqueues this launch: the cheapest way to repeat it.

        Geometry, shared memory and the stream are checked and resolved once, here; each call
        reads the arguments as they are then in :attr:`args` (change them with :meth:`set`).
        The callable keeps this launch alive; the stream must outlive it. Like :meth:`launch`, it
        makes the device's context current in the calling thread first where it is not.

        Raises
        ------
        ValueError
            ``grid``/``block`` not three positive ints, or ``smem`` negative.
        """
        grid, block = _dim3("grid", grid), _dim3("block", block)
        if isinstance(smem, bool) or not isinstance(smem, int) or smem < 0:
            raise ValueError(f"smem must be a non-negative int, got {smem!r}")
        if smem > self.kernel.smem_limit:
            self.kernel.allow_dynamic_smem(smem)
        dev = self._device
        raw = dev.as_stream(stream)
        fire = dev.driver.bound_launcher(self.kernel.func, grid, block, int(smem), raw, self._addr, self)

        def bound() -> None:
            if CURRENT.device is not dev:
                dev.set_current()
            fire()

        bound.owner = self
        return bound


class Kernel:
    """A loaded kernel entry: its driver handle and its parameter list from the source."""

    def __init__(self, module: "Module", name: str, params: tuple):
        self.module = module
        self.device = module.device
        self.name = name
        self.params = params
        self.device.use()
        self.func = self.device.driver.module_get_function(module.handle, name)
        self.args_type = type(f"{name}_args", (ctypes.Structure,), {"_fields_": list(params)})
        self.smem_limit = 48 * 1024

    def allow_dynamic_smem(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit (needed above 48 KiB)."""
        self.device.use()
        self.device.driver.set_max_dynamic_smem(self.func, nbytes)
        self.smem_limit = int(nbytes)

    def prepare(self, **values: Any) -> Launch:
        """A new :class:`Launch` with the given arguments set (the rest zero)."""
        return Launch(self).set(**values)

    def attribute(self, name: str) -> int:
        """A ``CU_FUNC_ATTRIBUTE_*`` value, e.g. ``"num_regs"`` or ``"local_size_bytes"``."""
        return self.device.driver.function_attribute(self.func, name)


class Module:
    """A module (cubin, or emulators on the emulated driver) loaded into one device."""

    def __init__(self, device: Device, filename: str, handle: Any, signatures: dict, compiled=None):
        self.device = device
        self.filename = filename
        self.handle = handle
        self.signatures = signatures
        self.compiled = compiled
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        """The entry ``name`` (loaded once per module, by whichever thread asks first)."""
        k = self._kernels.get(name)
        if k is None:
            if name not in self.signatures:
                raise KeyError(f"{self.filename} has no extern \"C\" __global__ entry {name!r}; "
                               f"it has: {', '.join(sorted(self.signatures))}")
            with self.device.lock:
                k = self._kernels.get(name)
                if k is None:
                    k = self._kernels[name] = Kernel(self, name, self.signatures[name])
        return k


def load_module(device: Device, filename: str, *, defines: tuple = (), struct_types: Mapping[str, type] | None = None,
                source_dir: str | os.PathLike | None = None) -> Module:
    """Load ``cuda_src/<filename>`` (or ``<source_dir>/<filename>``, its includes still from ``cuda_src``) into
    ``device`` (compiled once per process and cached on disk).

    On the emulated driver nothing is compiled: the module is the file's entry signatures and
    launches run the emulators registered for those names.
    """
    key = ("module", filename, tuple(defines), str(source_dir) if source_dir else None)
    mod = device.cache.get(key)
    if mod is not None:
        return mod
    with device.lock:  # one thread loads it; the others wait and take it
        mod = device.cache.get(key)
        if mod is None:
            mod = _load(device, key, filename, defines, struct_types, source_dir)
    return mod


def _load(device: Device, key: tuple, filename: str, defines: tuple, struct_types, source_dir) -> Module:
    source = (Path(source_dir or cuda_src_dir()) / filename).read_text()
    signatures = parse_signatures(source, struct_types, local_headers(source))
    if device.driver.runs_cubins:
        compiled = compile_source(filename, arch=device.arch, defines=tuple(defines), source_dir=source_dir)
        device.use()
        handle = device.driver.module_load(compiled.image)
    else:
        compiled = None
        device.use()
        handle = device.driver.module_load(EmuImage(filename, signatures))
    mod = Module(device, filename, handle, signatures, compiled)
    device.cache[key] = mod
    device.cache.setdefault("_unloaders", []).append(lambda: device.driver.module_unload(handle))
    return mod
