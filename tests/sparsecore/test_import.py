"""Importing the engine is quiet, like importing torch_tpu."""

import os
import subprocess
import sys


def test_importing_sparsecore_prints_nothing():
    result = subprocess.run([sys.executable, "-c", "import sparsecore"], capture_output=True, text=True,
                            env=dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("", "")
