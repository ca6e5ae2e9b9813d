"""Turning Python objects into registrable memory: buffer-protocol objects (numpy,
bytearray, memoryview, mmap), ``__dlpack__`` objects (torch CPU tensors, numpy; CUDA
tensors on a cuda engine), and raw ``(ptr, nbytes, device)`` tuples."""

from __future__ import annotations

from typing import Any

from .errors import InvalidArgumentError

_HOST_DEVICES = ("cpu", "host")

KDL_CPU = 1
KDL_CUDA = 2


def dlpack_device(obj: Any) -> tuple[int, int] | None:
    """``(device_type, device_id)`` of a ``__dlpack__`` object, else None."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or not hasattr(obj, "__dlpack__"):
        return None
    kind, ordinal = dev()
    return int(kind), int(ordinal)


def is_cuda_tensor(obj: Any) -> bool:
    """True for a ``__dlpack__`` object in CUDA device memory (a torch CUDA tensor)."""
    dev = dlpack_device(obj)
    return dev is not None and dev[0] == KDL_CUDA


def detached(obj: Any) -> Any:
    """``obj.detach()`` for torch tensors (DLPack refuses tensors that require grad)."""
    detach = getattr(obj, "detach", None)
    return detach() if callable(detach) else obj


def is_cuda_name(device: Any) -> bool:
    """True for a device named ``"cuda"`` or ``"cuda:N"`` (or a torch.device of CUDA)."""
    return str(device).startswith("cuda")


def _from_dlpack(obj: Any, what: str) -> Any:
    """A buffer-protocol view of a ``__dlpack__`` object living in host memory."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        kind, ordinal = dev()
        if int(kind) == KDL_CUDA:
            raise InvalidArgumentError(
                f"{what}: tensor lives in CUDA device memory (cuda:{int(ordinal)}), not host memory; "
                "register it on an Engine(device='cuda:N')"
            )
        if int(kind) != KDL_CPU:
            raise InvalidArgumentError(
                f"{what}: tensor lives on DLPack device type {int(kind)}, not host memory"
            )
    numpy_view = getattr(obj, "numpy", None)
    if callable(numpy_view):  # torch: shares the tensor's storage
        detach = getattr(obj, "detach", None)
        return (detach() if callable(detach) else obj).numpy()
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - numpy is how dlpack is read here
        raise InvalidArgumentError(f"{what}: reading a __dlpack__ object needs numpy") from e
    return numpy.from_dlpack(obj)


def byte_view(obj: Any, what: str) -> memoryview:
    """A flat, C-contiguous, byte-typed view of ``obj`` sharing its memory."""
    if isinstance(obj, memoryview):
        mv = obj
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            if hasattr(obj, "__dlpack__"):
                mv = memoryview(_from_dlpack(obj, what))
            else:
                raise InvalidArgumentError(
                    f"{what}: {type(obj).__name__} is neither a buffer nor a __dlpack__ object"
                ) from None
    if not mv.c_contiguous:
        raise InvalidArgumentError(
            f"{what}: array is not C-contiguous (shape {mv.shape}, strides {mv.strides}); "
            "pass a contiguous array (e.g. numpy.ascontiguousarray)"
        )
    if mv.nbytes == 0:
        raise InvalidArgumentError(f"{what}: buffer is empty")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def is_raw(obj: Any) -> bool:
    """True for a ``(ptr, nbytes, device)`` tuple."""
    return isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], int)


def check_raw(obj: tuple[Any, ...], what: str) -> tuple[int, int]:
    ptr, nbytes, device = obj
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgumentError(f"{what}: nbytes must be a positive int, got {nbytes!r}")
    if str(device) not in _HOST_DEVICES:
        hint = "register it on an Engine(device='cuda:N')" if is_cuda_name(device) else "expected 'cpu'"
        raise InvalidArgumentError(f"{what}: memory on device {device!r} is not host memory; {hint}")
    if ptr == 0:
        raise InvalidArgumentError(f"{what}: ptr must not be null")
    return ptr, nbytes


def layer_spans(nbytes: int, shape: tuple[int, ...], num_blocks: int | None, what: str) -> tuple[int, list[tuple[int, int, int]]]:
    """Blocks and spans of one per-layer paged tensor of ``nbytes``: ``[2, num_blocks,
    ...]`` (K and V halves, vLLM's layout) or ``[num_blocks, ...]``."""
    if len(shape) >= 2 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks):
        nb = shape[1]
        piece = nbytes // (2 * nb)
        return nb, [(0, piece, piece), (nb * piece, piece, piece)]
    if len(shape) >= 1 and (num_blocks is None or shape[0] == num_blocks):
        nb = shape[0]
        per = nbytes // nb
        return nb, [(0, per, per)]
    raise InvalidArgumentError(
        f"{what}: shape {shape} is neither [2, num_blocks, ...] nor [num_blocks, ...] with num_blocks={num_blocks}"
    )
