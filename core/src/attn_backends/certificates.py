"""Conformance certificates, public: what the conformance suite (a separate
distribution) needs from core to write one, and what ``attn-backends list``
reads back; it belongs to the judging layer, docs/DESIGN.md, section 5).

- :func:`environment_key`: the fields a certificate is stored under (backend,
  versions, platform, device kind) and the code digests it must match;
- :func:`store`: save a certificate in the cache (``ATTN_BACKENDS_CACHE_DIR``);
- :func:`status`: the certificate that counts for a backend on a platform here,
  or why none does.
"""

from .probe.certificates import KEY_FIELDS, CertificateStatus, environment_key, status, store

__all__ = ["KEY_FIELDS", "CertificateStatus", "environment_key", "status", "store"]
