"""The first load's progress bars (reading the GGUF, dequantizing its tensors,
building the tokenizer) show in a terminal and never when stderr is redirected: the real
functions, on a GGUF of two tiny layers written with ``gguf``'s own writer."""

from __future__ import annotations

import sys

import pytest
from _terminal import stderr_of

LOAD = """
import sys
import gguf
import numpy as np
from attn_gemma3.tokenizer import build
from attn_gemma3.weights import LAYER_TENSORS, Config, dequantized, read_gguf

cfg = Config(vocab=8, d_model=4, layers=2, heads=1, kv_heads=1, head_dim=4, ffn=8,
             context=16, window=8, rope_global=1e6, rope_local=1e4, eps=1e-6)
writer = gguf.GGUFWriter(sys.argv[1], "gemma3")
writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
for i in range(cfg.layers):
    for name in LAYER_TENSORS:
        writer.add_tensor(f"blk.{i}.{name}.weight",
                          np.ones((4,) if "norm" in name else (4, 4), np.float32))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
params = dequantized(read_gguf(sys.argv[1]), cfg, "float32")
assert params["embed"].shape == (8, 4) and len(params["layers"]) == 2
build(["<unk>", "a", "b", "ab"], [2, 1, 1, 1])
"""


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "redirected"])
def test_the_first_load_shows_progress_in_a_terminal_only(tmp_path, terminal):
    err = stderr_of([sys.executable, "-c", LOAD, str(tmp_path / "tiny.gguf")],
                    terminal=terminal)
    if terminal:
        assert "reading the GGUF: 100%" in err, err
        assert "dequantizing the GGUF's weights: 100%" in err and "28/28" in err, err
        assert "building the tokenizer: 100%" in err and "4/4" in err, err
    else:
        assert err == ""
