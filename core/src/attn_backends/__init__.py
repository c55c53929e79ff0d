"""attn-backends: swappable, provable JAX attention.

Public surface only; the implementation lives in private modules.
"""

from ._backend import Backend
from ._capabilities import DTYPES, PLATFORMS, Capabilities, HeadDims
from ._contract import API_VERSION, FEATURES, AttentionCall, Operands, bind
from ._errors import (
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
from ._attention import Attention
from ._discovery import LoadProblem, Origin
from ._environment import env_flag
from ._hookspec import ENTRY_POINT_GROUP, hookimpl
from ._platform import platform_name
from ._registry import Registry
from ._select import Explanation, Verdict, select

#: The process-wide registry: ``attn_backends.registry.get(device="tpu")``.
registry = Registry()

__all__ = [
    "API_VERSION",
    "DTYPES",
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "PLATFORMS",
    "Attention",
    "AttentionCall",
    "AttnBackendsError",
    "AttnBackendsWarning",
    "Backend",
    "Capabilities",
    "Explanation",
    "FallbackWarning",
    "HeadDims",
    "LoadProblem",
    "NoBackendError",
    "Operands",
    "Origin",
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
    "platform_name",
    "registry",
    "select",
]
