"""Layer 3, judging: probes, the one store of verdicts and certificates, code
digests, the float64 oracle and the tolerance table. Loaded on first use, never by
``import attn_backends``; public as ``attn_backends.oracle``,
``attn_backends.tolerances`` and ``attn_backends.certificates``."""
