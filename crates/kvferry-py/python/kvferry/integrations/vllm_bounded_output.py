"""Moved to :mod:`kvferry.integrations.vllm.bounded_output`; this name stays importable
(configurations that name the plugin by its old module keep working)."""

import sys

from .vllm import bounded_output as _bounded_output

sys.modules[__name__] = _bounded_output
