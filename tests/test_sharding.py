"""Runs tests/sharding_cases.py, tests/grad_compression_cases.py and tests/pipeline_cases.py in
processes with 8 host devices (a device count is fixed when JAX starts, and the rest of the
suite runs on one, as a user does)."""

import os
import subprocess
import sys

import pytest


# Processes of about equal length (the ZeRO-3 cases, the other sharding cases, the
# compressed-gradient cases, the pipeline's), so that the suite's workers run them side by side.
@pytest.mark.slow
@pytest.mark.parametrize(
    "cases, keyword",
    [("sharding_cases.py", "zero3"), ("sharding_cases.py", "not zero3"),
     ("grad_compression_cases.py", ""), ("pipeline_cases.py", "")],
)  # fmt: skip
def test_cases_pass_on_eight_host_devices(tmp_path, cases, keyword):
    here = os.path.dirname(__file__)
    env = {**os.environ, "LOWMEM_TEST_DEVICES": "8"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         os.path.join(here, cases), "-k", keyword, "--basetemp", str(tmp_path / "cases")],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(here),
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
