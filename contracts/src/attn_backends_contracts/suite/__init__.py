"""The conformance tests.

Run them with ``pytest --pyargs attn_backends_contracts --attn-backend=NAME``.
"""
