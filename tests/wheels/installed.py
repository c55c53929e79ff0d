"""The attn-backends distributions in this venv come from the wheels, not the checkout.

``installed.py REPO VARIANT``: every installed distribution named attn-backend*
must be a regular (not editable) install whose modules import from this venv's
site-packages, never from REPO; VARIANT ``xla`` must hold core and xla_native
and neither the reference backend nor the suite (wheels given with --wheel may
add others).
"""

from __future__ import annotations

import importlib
import json
import sys
from importlib import metadata
from pathlib import Path

repo, variant = Path(sys.argv[1]).resolve(), sys.argv[2]
ours = {}
for dist in metadata.distributions():
    name = dist.metadata["Name"]
    if name.startswith("attn-backend"):
        ours[name] = dist
problems = []
for name, dist in sorted(ours.items()):
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        problems.append(f"{name}: installed editable")
    top = (dist.read_text("top_level.txt") or "").split()
    if not top:
        top = sorted({str(f).split("/")[0] for f in dist.files or () if str(f).endswith(".py")})
    for module in top:
        where = Path(importlib.import_module(module).__file__).resolve()
        if repo in where.parents or not str(where).startswith(sys.prefix):
            problems.append(f"{name}: {module} imports from {where}, not from {sys.prefix}")
unwanted = {"attn-backend-reference", "attn-backends-contracts"} & set(ours)
if variant == "xla" and (unwanted or not {"attn-backends", "attn-backend-xla-native"} <= set(ours)):
    problems.append(f"[xla] install: expected attn-backends and attn-backend-xla-native (plus "
                    f"any --wheel), without reference or the suite; got {sorted(ours)}")
assert not problems, "\n".join(problems)
print("installed from wheels:", ", ".join(f"{n} {d.version}" for n, d in sorted(ours.items())))
