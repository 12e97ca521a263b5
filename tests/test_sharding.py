"""Runs tests/sharding_cases.py and tests/grad_compression_cases.py in a process with 8 host
devices (a device count is fixed when JAX starts, and the rest of the suite runs on one, as a
user does)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sharding_cases_pass_on_eight_host_devices(tmp_path):
    here = os.path.dirname(__file__)
    env = {**os.environ, "LOWMEM_TEST_DEVICES": "8"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         os.path.join(here, "sharding_cases.py"), os.path.join(here, "grad_compression_cases.py"),
         "--basetemp", str(tmp_path / "cases")],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(here),
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
