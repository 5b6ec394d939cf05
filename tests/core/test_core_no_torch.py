import subprocess
import sys


def test_core_imports_without_torch():
    code = ("import sys, tokenmill.core.scheduler, tokenmill.core.kv_cache_manager, "
            "tokenmill.sampling_params, tokenmill.config; "
            "assert 'torch' not in sys.modules, 'core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
