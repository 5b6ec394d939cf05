"""The test suite's port range is the user's to move (TOKENMILL_TEST_PORTS)."""

import os
import subprocess
import sys

import pytest

from tests.serving import _port_range

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_free_ports_come_from_the_configured_range():
    code = ("from tests.serving import free_port; ps = [free_port() for _ in range(20)]; "
            "assert len(set(ps)) == 20 and all(41000 <= p < 41100 for p in ps), ps")
    done = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "TOKENMILL_TEST_PORTS": "41000-41100"})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("text", ["x", "30000", "100-200", "30000-30010", "50000-40000"])
def test_a_bad_range_is_refused_with_its_form(text):
    with pytest.raises(ValueError, match="TOKENMILL_TEST_PORTS"):
        _port_range(text)
