"""The fault-injection table (benchmarks/fault_injection.py): every case keeps every good
checkpoint and restores no wrong value."""

from conftest import load_benchmark


def test_every_fault_keeps_the_good_checkpoints_and_restores_no_wrong_value(tmp_path):
    faults = load_benchmark("fault_injection")
    rows = faults.run_all(str(tmp_path))
    assert len(rows) >= 30
    for row in rows:
        assert row["intact"], row
        assert row["restored_as_saved"] is not False, row  # None: nothing restored (refused)
    sees = {row["case"]: row["sees"] for row in rows}
    # A flipped byte the array format does not catch is caught by the checksum saved beside it.
    assert any("fail the checksum saved with them" in s for s in sees.values())
    assert sees["killed mid-write (a step's temporary directory left)"] == "resumed from step 3"
    refused = [c for c, s in sees.items() if c.startswith("resume with ")]
    assert refused and all(sees[c].startswith("error: checkpoint_dir=") for c in refused)


def test_a_checkpoint_of_another_structure_is_not_called_corrupt(tmp_path):
    """A directory from before run files existed, resumed by a command that builds another
    state: the error names the difference and no checkpoint is moved aside."""
    import numpy as np
    import pytest

    from lowmem_jax.checkpointing import Checkpointer, CheckpointError

    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((4, 3), step, np.float32)})
    with pytest.raises(CheckpointError, match=r"w saved with shape \(4, 3\), \(5, 3\) here"):
        ckpt.restore_newest({"w": np.zeros((5, 3), np.float32)})
    with pytest.raises(CheckpointError, match=r"leaves only in this command's state: \['v'\]"):
        ckpt.restore_newest({"v": np.zeros((4, 3), np.float32)})
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1", "2"]
    assert int(ckpt.restore_newest({"w": np.zeros((4, 3), np.float32)})["w"][0, 0]) == 2
    ckpt.close()
