"""tests/cpu: the tests that need no GPU.

Most of their time is NVRTC compiling kernels (test_compile*.py). Those programs compile in a
pool of threads (``helpers.compile_program``; NVRTC releases the GIL): when the run starts,
the programs of the selected compile tests (each module's ``compile_jobs()``) go to the pool,
costliest first, and the tests that wait for them run after every other test of the
session. So the compiles overlap the rest of the run on the cores the other tests leave (all
but one), and take every core once those tests start. (An xdist worker does not start them
early: its compile tests compile what they need when they run.)
"""

import os

import pytest
from helpers import compile_on_every_core, start_compiles, stop_compiles

_HERE = os.path.dirname(os.path.abspath(__file__))


def _compile_module(item):
    path = os.path.abspath(str(item.path))
    return os.path.dirname(path) == _HERE and os.path.basename(path).startswith("test_compile")


_jobs = {}


def _module_jobs(module):
    """A compile module's [(test function, its parameters, program)] (its compile_jobs())."""
    if module not in _jobs:
        _jobs[module] = getattr(module, "compile_jobs", list)()
    return _jobs[module]


def _compiles(item):
    """Whether a test waits for programs of the pool (a test of a compile module that has
    programs in its compile_jobs()); the other tests of those modules check sets of plans."""
    if not _compile_module(item) or getattr(item, "module", None) is None:
        return False
    return any(name == item.originalname for name, _, _ in _module_jobs(item.module))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    compiling = [item for item in items if _compiles(item)]
    if compiling:
        items[:] = [item for item in items if not _compiles(item)] + compiling


def pytest_collection_finish(session):
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput"):
        return
    selected = {}          # module -> [(test function, its parameters)]
    for item in session.items:
        if _compiles(item):
            params = getattr(getattr(item, "callspec", None), "params", {})
            selected.setdefault(item.module, []).append((item.originalname, params))
    jobs = []
    for module, tests in selected.items():
        for name, wants, job in _module_jobs(module):
            if any(name == test and all(params.get(k) == v for k, v in wants.items()) for test, params in tests):
                jobs.append(job)
    if jobs:
        start_compiles(jobs)


def pytest_runtest_setup(item):
    if _compiles(item):
        compile_on_every_core()


def pytest_sessionfinish(session, exitstatus):
    stop_compiles()
