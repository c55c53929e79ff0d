"""Layer 2, choosing and calling: discovery, the registry, selection, dispatch
(``Served``) and the single-device ``Attention``. Imports only the contract; the
prober and the parallel layer above it reach it as values (docs/DESIGN.md,
"Core's layers")."""
