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
    assert sees["killed mid-write (a step's temporary directory left)"] == "resumed from step 3"
    refused = [c for c, s in sees.items() if c.startswith("resume with ")]
    assert refused and all(sees[c].startswith("error: checkpoint_dir=") for c in refused)


def test_a_checkpoint_of_another_structure_is_not_called_corrupt(tmp_path):
    """A directory from before run files existed, resumed by a command that builds another
    state: the error names the difference and no checkpoint is moved aside."""
    import numpy as np
    import pytest

    from lowmem_jax.training.checkpointing import Checkpointer, CheckpointError

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


def test_values_that_fail_their_checksum_are_moved_aside_not_restored(tmp_path):
    """Orbax's array files carry no checksum (a flipped byte in an OCDBT data file restored
    other values, silently): the SHA-256 saved beside each checkpoint is checked on restore."""
    import numpy as np
    import pytest

    from lowmem_jax.training.checkpointing import Checkpointer

    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((4, 3), step, np.float32)})
    (tmp_path / "2.sha256").write_text("0" * 64)  # as if step 2's values had changed on disk
    with pytest.warns(RuntimeWarning, match="step 2 .* fail the checksum saved with them"):
        restored = ckpt.restore_newest({"w": np.zeros((4, 3), np.float32)})
    assert int(restored["w"][0, 0]) == 1 and (tmp_path / "2.corrupt").is_dir()
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == ["1.sha256", "2.sha256"]
    ckpt.close()
