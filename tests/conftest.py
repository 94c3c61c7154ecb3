import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Deterministic property tests: CI explores the same examples every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
# On a GPU machine (HYPOTHESIS_PROFILE=gpu): the kernel tests run compiled, so explore far more.
settings.register_profile("gpu", derandomize=True, deadline=None, print_blob=True, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Without CUDA the Triton kernels run in Triton's interpreter; triton reads the switch when first
# imported, which torch.compile may do in any test before the kernel tests run.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Tiny models are dispatch-bound: one thread avoids oversubscribing the two CI cores.
torch.set_num_threads(1)

# Files whose kernels run in Triton's interpreter: a real inductor compile earlier in the same process
# breaks the interpreter, so these run first on their worker, whatever their names.
INTERPRETER_FIRST = ("test_kernels.py", "test_kernels_top_p.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in INTERPRETER_FIRST)  # stable: file order kept otherwise


FIXTURES = Path(__file__).parent / "fixtures" / "dflash_reference"
# The same reference outputs for a drafter conditioned on the target's LAST layer (post-norm feature).
FIXTURES_LAST_LAYER = Path(__file__).parent / "fixtures" / "dflash_reference_last_layer"
REFERENCE_FIXTURES = (FIXTURES, FIXTURES_LAST_LAYER)


@pytest.fixture(autouse=True)
def no_background_builds(monkeypatch):
    """A command started on an empty compile cache builds its compiled rounds in a detached process
    (`commands.common.build_in_background`): never from a test, where it would outlive the test."""
    import dflow_rt.commands.main
    import dflow_rt.commands.serve

    for module in (dflow_rt.commands.main, dflow_rt.commands.serve):
        monkeypatch.setattr(module, "build_in_background", lambda argv, meanwhile: None)


@pytest.fixture(autouse=True)
def kernels_as_they_were(monkeypatch):
    """`generate` and `serve` on a machine without the C++ kernels built defer them for the whole
    process (`cpu_ops.defer`): whatever a test's commands decided is undone after it."""
    from dflow_rt.kernels.cpu import ops

    monkeypatch.setattr(ops, "_ready", ops._ready)
    monkeypatch.setattr(ops, "_deferred", ops._deferred)


@pytest.fixture(autouse=True)
def fresh_timings(tmp_path, monkeypatch):
    """Each test's Runtimes keep their fallback timings apart (`RuntimeConfig.keep_timings`): a choice
    of widths learned by one test would otherwise steer the next."""
    from dflow_rt.engine.policy import TimingsFile

    monkeypatch.setattr(TimingsFile, "directory", staticmethod(lambda: tmp_path / "timings"))


def load_pair(directory: Path):
    import dflow_rt

    target = dflow_rt.load_target(directory / "target")
    return target, dflow_rt.load_drafter(directory / "drafter", target)


@pytest.fixture(scope="session")
def reference_pair():
    """The target and drafter the public DFlash implementation produced the fixtures with."""
    return load_pair(FIXTURES)
