"""Fault injection for the reliability tests (never installed; tests put this folder on
PYTHONPATH, so every Python process of a test server runs it at start-up, the engine-core
process included). TOKENMILL_TEST_FAULT=crash:N or hang:N: from the (N+1)-th forward step on,
the model forward raises or sleeps forever, like vLLM's `evil_forward` tests;
TOKENMILL_TEST_FAULT_STAMP=FILE records when the fault struck. slow:MS: every forward step
takes MS milliseconds longer per token it computes (an engine slowed down, as a busy CPU
slows it, but making progress)."""

import os

_SPEC = os.environ.get("TOKENMILL_TEST_FAULT")

if _SPEC:
    import time

    from tokenmill.worker import model_runner

    _kind, _after = _SPEC.split(":")
    _original = model_runner.ModelRunner.execute
    _calls = [0]

    def _faulty_execute(self, step):
        if _kind == "slow":
            time.sleep(step.num_batched_tokens * float(_after) / 1000)
            return _original(self, step)
        _calls[0] += 1
        if _calls[0] > int(_after):
            stamp = os.environ.get("TOKENMILL_TEST_FAULT_STAMP")
            if stamp and _calls[0] == int(_after) + 1:  # when the fault struck (wall clock)
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
            if _kind == "crash":
                raise RuntimeError("injected fault: the model forward failed")
            time.sleep(3600)  # hang
        return _original(self, step)

    model_runner.ModelRunner.execute = _faulty_execute
