"""Layer 1, the contract: the call (``AttentionCall``, ``bind``), the capability
manifest, errors, the plugin API (``Backend``, the hook specification) and the
environment (platforms, ``ATTN_BACKENDS_*`` settings). Imports nothing above it;
users import these names from ``attn_backends``."""
