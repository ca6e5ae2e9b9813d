"""KV that belongs to the request: a publication is bound to the prompt it was
computed from, and a decode reads only a publication bound to its own prompt.

Pure Python (importable without vLLM).

- The prefill publishes a finished request's blocks under
  :func:`publication_key` ``(request id, prompt_digest(prompt))`` —
  ``<request id>@prompt-<32 hex digits>`` — and returns that key as the params'
  ``remote_request_id``, the field every proxy forwards (NIXL's own field), so the
  digest travels inside the very name the decode reads and cannot be separated from it.
- The decode, before any read is issued (the scheduler's ``update_state_after_alloc``),
  computes the digest of *its own* request's prompt and reads the key only if it ends
  with that digest (:func:`refusal`). Params that name another prompt's publication —
  a router that swapped two requests' params, or rebuilt params from another
  request's fields — are refused: a load error of kind ``wrong_prompt``
  (:class:`WrongPromptError`), handled by ``kv_load_failure_policy``, never a read.
  A key that carries no digest (a prefill of a kvferry before this check, or params
  not made by a kvferry prefill) is refused the same way: unverifiable KV is never
  loaded.

:func:`prompt_digest` is BLAKE2b (128 bits, personalised) over the prompt's length
and its token ids as little-endian 64-bit integers: the whole prompt, the same in
every process and on every machine (no Python ``hash()``): a few milliseconds per
100,000 tokens, once per request on each side.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["WrongPromptError", "prompt_digest", "publication_key", "key_digest", "refusal", "DIGEST_MARK"]

DIGEST_MARK = "@prompt-"
"""What separates a publication key's request id from its prompt digest."""

_DIGEST_HEX = 32  # 128 bits
_PERSON = b"kvferry-prompt1"  # the digest's version: another input encoding, another name


class WrongPromptError(ValueError):
    """The KV a request's params name was not computed from the request's prompt (or
    cannot be shown to have been): refused before any read, a load error."""


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The digest of a whole prompt (32 hex digits); see the module docs."""
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=_DIGEST_HEX // 2, person=_PERSON)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids)
    return h.hexdigest()


def publication_key(request_id: str, digest: str) -> str:
    """The key a prefill publishes ``request_id``'s blocks under: bound to its prompt."""
    return f"{request_id}{DIGEST_MARK}{digest}"


def key_digest(key: str) -> str | None:
    """The prompt digest a publication key carries, or None when it carries none."""
    _, mark, digest = key.rpartition(DIGEST_MARK)
    if not mark or len(digest) != _DIGEST_HEX or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def refusal(key: str, token_ids: Sequence[int]) -> str | None:
    """Why the publication ``key`` must not be loaded for a request whose prompt is
    ``token_ids``; None when the key is bound to exactly that prompt."""
    theirs = key_digest(key)
    mine = prompt_digest(token_ids)
    if theirs == mine:
        return None
    if theirs is None:
        return (
            f"the publication key {key!r} carries no prompt digest, so its KV cannot be shown to be this "
            f"request's prompt (a prefill instance of a kvferry before the prompt check, or params not made "
            f"by a kvferry prefill: upgrade prefill instances first)"
        )
    return (
        f"the publication {key!r} holds the KV of another prompt (prompt digest {theirs}; this request's "
        f"{len(token_ids)}-token prompt has {mine}): were two requests' kv_transfer_params mixed up?"
    )
