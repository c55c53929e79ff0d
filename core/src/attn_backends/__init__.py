"""attn-backends: swappable, provable JAX attention.

Public surface only; the implementation lives in the layer packages (``contract``,
``choose``, ``probe``, ``parallel``, ``cli``), lowest first.
"""

from ._wiring import Registry, registry
from .choose.attention import Attention
from .choose.discovery import LoadProblem, Origin
from .choose.select import Explanation, Verdict, select
from .contract.backend import ENTRY_POINT_GROUP, Backend, hookimpl
from .contract.call import API_VERSION, FEATURES, AttentionCall, Operands
from .contract.capabilities import CLAIMABLE_DTYPES, DTYPES, PLATFORMS, Capabilities, HeadDims
from .contract.environment import env_flag, local_work, platform_name
from .contract.errors import (
    AgreementError,
    AgreementWarning,
    AttnBackendsError,
    AttnBackendsWarning,
    FallbackWarning,
    NoBackendError,
    PlatformUnavailableError,
    PluginConflictError,
    PluginError,
    PluginWarning,
    UnknownBackendError,
    UnsupportedError,
)
from .contract.paged import (
    CANONICAL_LAYOUT,
    PAGED_FEATURES,
    QUANTIZED_CACHE_DTYPES,
    KVCache,
    PagedBackend,
    PagedBatch,
    PagedCall,
    PagedCapabilities,
)

__all__ = [
    "API_VERSION",
    "CANONICAL_LAYOUT",
    "CLAIMABLE_DTYPES",
    "DTYPES",
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "PLATFORMS",
    "QUANTIZED_CACHE_DTYPES",
    "AgreementError",
    "AgreementWarning",
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
    "LoadProblem",
    "NoBackendError",
    "Operands",
    "Origin",
    "PAGED_FEATURES",
    "PagedBackend",
    "PagedBatch",
    "PagedCall",
    "PagedCapabilities",
    "PlatformUnavailableError",
    "PluginConflictError",
    "PluginError",
    "PluginWarning",
    "Registry",
    "UnknownBackendError",
    "UnsupportedError",
    "Verdict",
    "bind",
    "env_flag",
    "hookimpl",
    "local_work",
    "platform_name",
    "registry",
    "select",
]


def __getattr__(name: str) -> object:
    """``attn_backends.bind`` loads the argument checks on first use, not at import."""
    if name == "bind":
        from .contract.arguments import bind

        return bind
    raise AttributeError(f"module 'attn_backends' has no attribute {name!r}")
