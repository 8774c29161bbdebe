"""LowDiff on 2 gloo processes with DDP: bit-exact restore and continuation for top-k, int8 and dense."""
from __future__ import annotations

import json

import pytest

from tests import _ddp_worker, _training as T

CASES = [("mlp", "adamw", "topk"), ("gpt", "adamw", "topk"), ("gpt", "adamw", "dense"),
         ("mlp", "adamw", "int8"), ("mlp_bn", "sgd", "topk"), ("gpt", "sgd", "int8")]


@pytest.mark.procs
def test_ddp_bit_exact_restore_and_continuation(tmp_path):
    results = tmp_path / "results.json"
    T.spawn(_ddp_worker.main, args=(2, T.free_port(), str(tmp_path), CASES, str(results)), nprocs=2)
    got = json.loads(results.read_text())
    assert set(got) == {f"{k}/{o}/{h}" for k, o, h in CASES}
