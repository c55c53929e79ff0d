"""Exception and warning classes. Each one means exactly one thing."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence

#: The attn_backends package (this file is in its contract/ layer).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class AttnBackendsError(Exception):
    """Base class of every error raised by attn-backends itself."""


class UnsupportedError(AttnBackendsError, NotImplementedError):
    """A backend cannot serve this call (a feature, dtype, shape or platform it lacks)."""


class NoBackendError(AttnBackendsError, RuntimeError):
    """No installed backend can serve the call; carries every backend's reasons.

    ``reasons`` maps backend name to the list of reasons it was rejected.
    """

    def __init__(self, message: str, reasons: Mapping[str, Sequence[str]]):
        self.reasons = {name: list(r) for name, r in reasons.items()}
        lines = [message]
        for name, why in sorted(self.reasons.items()):
            lines.append(f"  {name}: " + "; ".join(why))
        if not self.reasons:
            lines.append(
                "  no backend is installed: pip install attn-backend-reference "
                "(or attn-backends[xla])"
            )
        super().__init__("\n".join(lines))


class UnknownBackendError(AttnBackendsError, LookupError):
    """``backend=`` or a CLI argument named a backend that is not registered."""


class PlatformUnavailableError(AttnBackendsError, RuntimeError):
    """A call must run on a platform that JAX cannot see on this machine."""


class AgreementError(AttnBackendsError, RuntimeError):
    """The processes of a multi-process run found no backend every one of them
    serves, or could not hear from each other in time (docs/MANY_CHIPS.md,
    "Many hosts"). Every process raises it, with the same message when the
    processes could exchange what they serve."""


class PluginError(AttnBackendsError):
    """A plugin failed to load or register (raised only in strict mode)."""


class PluginConflictError(AttnBackendsError):
    """Two distributions register the same backend name."""


class AttnBackendsWarning(UserWarning):
    """Base class of every warning emitted by attn-backends."""


class PluginWarning(AttnBackendsWarning):
    """A plugin was skipped: it failed to import or register, or is incompatible."""


class FallbackWarning(AttnBackendsWarning):
    """A higher-priority backend was passed over for a call; says which and why."""


class AgreementWarning(AttnBackendsWarning):
    """The processes of a multi-process run agreed on a backend that some process
    would not have chosen alone (another ``prefer``, tuning table or verdict)."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside this package."""
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def renamed(old: str, new: str) -> None:
    """Warn that ``old`` is the pre-0.2 name of ``new`` (a DeprecationWarning; the old
    name goes in 0.3)."""
    warn(f"{old} is deprecated: use {new} (attn-backends 0.2 names quantized K and V "
         "kv_dtype everywhere; the old name goes in 0.3)", DeprecationWarning)
