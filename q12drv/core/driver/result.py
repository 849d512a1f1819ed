"""The one place a ``CUresult`` becomes an exception (for the real and the emulated driver)."""

from __future__ import annotations

from cuda.bindings import driver as _cu

from ..errors import CudaError

__all__ = ["check", "fail", "result_code", "cuda_error"]

_SUCCESS = 0


def _describe(code: int) -> str:
    try:
        err, text = _cu.cuGetErrorString(_cu.CUresult(code))
        if int(err) == 0 and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # no libcuda: the name alone has to do
        pass
    return ""


def check(call: str, err) -> None:
    """Raise :class:`CudaError` naming ``call`` when ``err`` is not ``CUDA_SUCCESS``."""
    code = int(err)
    if code == _SUCCESS:
        return
    try:
        name = _cu.CUresult(code).name
    except ValueError:
        name = f"CUresult({code})"
    raise CudaError(name, code, call, _describe(code))


def result_code(name: str) -> int:
    """The numeric value of a ``CUresult`` name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"`` -> 2."""
    try:
        return int(getattr(_cu.CUresult, name))
    except AttributeError:
        raise ValueError(f"{name!r} is not a CUresult name") from None


def cuda_error(call: str, name: str, detail: str = "") -> CudaError:
    """The :class:`CudaError` the real driver would give for ``name`` from ``call``."""
    code = result_code(name)
    return CudaError(name, code, call, detail or _describe(code))


def fail(call: str, name: str) -> None:
    """Raise the :class:`CudaError` the real driver would raise for ``name`` from ``call``."""
    raise cuda_error(call, name)
