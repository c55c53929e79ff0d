"""attn-backends: swappable, provable JAX attention.

Public surface only; the implementation lives in the layer packages (``contract``,
``choose``, ``probe``, ``parallel``), lowest first. What a backend imports is in
:mod:`attn_backends.authoring`.
"""

import importlib
import warnings

from .choose.attention import Attention
from .choose.registry import Registry, registry
from .choose.select import Explanation, Verdict
from .contract.backend import ENTRY_POINT_GROUP, Backend, hookimpl
from .contract.call import API_VERSION, FEATURES, AttentionCall, Operands
from .contract.capabilities import Capabilities, HeadDims
from .contract.environment import local_work
from .contract.errors import (
    AgreementError,
    AttnBackendsError,
    AttnBackendsWarning,
    FallbackWarning,
    NoBackendError,
    PlatformUnavailableError,
    PluginError,
    PluginWarning,
    UnsupportedError,
)

__all__ = [
    "API_VERSION",
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "AgreementError",
    "Attention",
    "AttentionCall",
    "AttnBackendsError",
    "AttnBackendsWarning",
    "Backend",
    "Capabilities",
    "Explanation",
    "FallbackWarning",
    "HeadDims",
    "KVCache",
    "NoBackendError",
    "Operands",
    "PagedBackend",
    "PagedBatch",
    "PagedCall",
    "PagedCapabilities",
    "PlatformUnavailableError",
    "PluginError",
    "PluginWarning",
    "Registry",
    "UnsupportedError",
    "Verdict",
    "bind",
    "hookimpl",
    "local_work",
    "registry",
]

#: Public names loaded on first use, not at import: the argument checks and the
#: paged contract (a dense call never loads it).
_LAZY = {"bind": "attn_backends.contract.arguments",
         **dict.fromkeys(("KVCache", "PagedBackend", "PagedBatch", "PagedCall",
                          "PagedCapabilities"), "attn_backends.contract.paged")}

#: Names this module exported before 0.2, now in their own modules (a
#: DeprecationWarning names the new place; they go in 0.3).
MOVED = {
    **dict.fromkeys(("DTYPES", "CLAIMABLE_DTYPES", "PLATFORMS", "CANONICAL_LAYOUT",
                     "PAGED_FEATURES", "QUANTIZED_CACHE_DTYPES", "env_flag"),
                    "attn_backends.authoring"),
    **dict.fromkeys(("AgreementWarning", "PluginConflictError", "UnknownBackendError"),
                    "attn_backends.contract.errors"),
    "select": "attn_backends.choose.select",
    "platform_name": "attn_backends.contract.environment",
    **dict.fromkeys(("LoadProblem", "Origin"), "attn_backends.choose.discovery"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in MOVED:
        new = "QUANTIZED_KV_DTYPES" if name == "QUANTIZED_CACHE_DTYPES" else name
        warnings.warn(f"attn_backends.{name} moved to {MOVED[name]}.{new}; the old name "
                      "goes in attn-backends 0.3", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(MOVED[name]), new)
    raise AttributeError(f"module 'attn_backends' has no attribute {name!r}")
