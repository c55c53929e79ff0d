"""attn-backends-contracts: the conformance suite any attention backend must pass.

Run it with ``pytest --pyargs attn_backends_contracts --attn-backend=NAME`` or
``attn-backends check NAME [--json FILE]`` (:func:`run_check`). The case
tables live in :mod:`attn_backends_contracts.cases`, the tolerances in
:mod:`attn_backends_contracts.tolerances`. Importing this package imports
neither JAX nor attn-backends.
"""

from ._check import run_check

__all__ = ["run_check"]
