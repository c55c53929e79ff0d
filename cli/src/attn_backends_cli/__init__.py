"""The ``attn-backends`` command line (``cli.main:main``), its reports and benchmarks:
the top layer, above everything but the public surface."""
