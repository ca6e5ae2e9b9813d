# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""The SGLang general plugin (entry point ``kvferry`` in the ``sglang.srt.plugins``
group): makes ``--disaggregation-transfer-backend kvferry`` a valid choice of SGLang's
own argument parser and routes it to this backend, without patching SGLang's sources.

:func:`register` runs in every SGLang process when ``load_plugins()`` runs (before the
arguments are parsed). It

- adds ``kvferry`` to SGLang's list of transfer-backend choices (its extension hook,
  ``add_disagg_transfer_backend_choices``);
- adds a ``KVFERRY`` member to SGLang's ``TransferBackend`` enum, so that
  ``TransferBackend("kvferry")`` resolves wherever SGLang converts the name;
- registers an ``AROUND`` hook on ``get_kv_class`` through SGLang's ``HookRegistry``
  that answers this backend's manager, sender, receiver and bootstrap server for
  ``TransferBackend.KVFERRY`` and defers to SGLang for every other backend.

It refuses (raises, which SGLang logs as a failed plugin) any sglang other than
:data:`~kvferry.integrations.sglang.SGLANG_VERSION`: the enum and hook targets are that
release's.
"""

from __future__ import annotations

from typing import Any

BACKEND = "kvferry"


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """``enum_cls(value)``, adding the member if the enum lacks it."""
    try:
        return enum_cls(value)
    except ValueError:
        pass
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def _get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import classes

    return classes()[class_type.value]


def register() -> None:
    """The entry point: see the module docs. Idempotent."""
    from . import check_version

    check_version()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member(TransferBackend, "KVFERRY", BACKEND)
    target = "sglang.srt.disaggregation.utils.get_kv_class"
    if not any(h is _get_kv_class_hook for _, h, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, _get_kv_class_hook, HookType.AROUND)
