"""Large checkpoint files are checked when they load, not when the run dir is opened.

Opening a run dir checks every checkpoint file's size, and the checksums of files under 1 MiB
(store/ckpt.py `check`); a large state file (a real model's moments are gigabytes) is checked
against its CRC while `train/checkpoint.load` reads it. The tiny test models have no state file
that large, so that path is exercised here with an embedding of 9000 x 32 fp32 moments (1.1 MiB).
"""

from __future__ import annotations

import pytest
import torch

from horizon_cli.store import Store, ckpt
from horizon_cli.train import checkpoint
from tests.support.oracle import make_engine, make_store, micro_batches, one_thread, random_rows  # noqa: F401


def test_a_flipped_bit_in_a_large_state_file_is_caught_when_it_loads(tmp_path):
    model, store = make_store(tmp_path, "llama", False, vocab_size=9000)
    eng = make_engine(store)
    try:
        eng.step(micro_batches(random_rows(2, 9000), 2), 1e-3)
        ck = checkpoint.save(eng, tmp_path / "run", 1, {"step": 1, "adam_step": eng.adam_step}, "", store, 1)
    finally:
        eng.close()
    victim = ck / "state" / "embed.m.bin"
    size = victim.stat().st_size
    assert size > 1 << 20  # beyond what the shallow check reads
    data = bytearray(victim.read_bytes())
    data[size // 2] ^= 0x10
    victim.write_bytes(bytes(data))

    assert ckpt.check(ck) is None  # sizes and small files only: it looks intact
    assert ckpt.check(ck, deep=True) == f"{victim}: checksum mismatch"
    eng = make_engine(Store.open(ck))
    try:
        with pytest.raises(ckpt.CheckpointDamaged, match="embed.m.bin: checksum mismatch"):
            checkpoint.load(eng, ck)
        # an intact copy of the same bytes loads, and restores the moments exactly
        data[size // 2] ^= 0x10
        victim.write_bytes(bytes(data))
        checkpoint.load(eng, ck)
        m = eng.host["embed"].state["m"]
        assert torch.equal(m.view(torch.uint8), torch.frombuffer(bytearray(data), dtype=torch.uint8))
    finally:
        eng.close()
