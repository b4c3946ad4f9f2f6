"""Every code block of the README and docs/ runs (or, for commands, is checked here):
Python blocks on the CPU (the NumPy path); blocks marked ``<!-- gpu -->`` run in the GPU
suite (tests/gpu/test_docs_gpu.py); bash blocks name extras that exist and benchmark
commands the CLI accepts; text blocks are output and signatures."""

import os
import re
import shlex
import sys

import pytest
from helpers import ROOT, doc_blocks

BLOCKS = doc_blocks()
CPU_BLOCKS = [b for b in BLOCKS if b[2] == "python" and not b[3]]
BASH_BLOCKS = [b for b in BLOCKS if b[2] in ("bash", "sh")]
OPTIONAL = ("torch", "transformers", "kernels")


def test_every_block_has_a_kind():
    kinds = {b[2] for b in BLOCKS}
    assert kinds <= {"python", "bash", "sh", "text", ""}, kinds
    untagged = [b[:2] for b in BLOCKS if b[2] == "" and "ci-test" not in _before(b)]
    assert not untagged, f"code blocks without a language (python, bash or text): {untagged}"
    assert CPU_BLOCKS and BASH_BLOCKS


def _before(block):
    name, line = block[:2]
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read().split("\n")[line - 2]


@pytest.mark.parametrize("name,line,lang,gpu,code", CPU_BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in CPU_BLOCKS])
def test_python_block_runs_on_the_cpu(name, line, lang, gpu, code):
    assert "import cupy\n" not in code and "cuda" not in code.replace("cupy_rmsnorm", ""), \
        f"{name}:{line} needs a GPU: mark it <!-- gpu -->"
    try:
        exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__docs__"})
    except ModuleNotFoundError as e:   # the optional packages: CI's second setup has them and runs the block
        if e.name not in OPTIONAL:
            raise
        pytest.skip(f"{name}:{line} needs {e.name}, which is not installed")


def _commands(code):
    """The commands of a bash block: lines, continuations joined, split at && and ;."""
    code = code.replace("\\\n", " ")
    for line in code.split("\n"):
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            yield from (c.strip() for c in re.split(r"&&|;", line) if c.strip())


def _extras():
    """The extras pyproject.toml declares (the names of its optional-dependencies table)."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        table = f.read().split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^(\w+) = ", table, re.M))


@pytest.mark.parametrize("name,line,lang,gpu,code", BASH_BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BASH_BLOCKS])
def test_bash_block_commands_are_valid(name, line, lang, gpu, code):
    from cupy_rmsnorm.bench import cli
    extras = _extras()
    for command in _commands(code):
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            for w in words[2:]:
                m = re.fullmatch(r"\.\[([\w,]+)\]", w)
                if m:
                    assert set(m.group(1).split(",")) <= extras, f"{name}:{line}: unknown extra in {w}"
                else:
                    assert w == "." or re.fullmatch(r"[A-Za-z0-9_.\-]+", w), f"{name}:{line}: {w}"
        elif words[:3] == ["python", "-m", "cupy_rmsnorm.bench"]:
            cli.parse_args(words[3:])          # SystemExit(2) on a bad command line
        elif words[:1] == ["python"] and words[1:2] == ["benchmarks/host_overhead.py"]:
            assert os.path.isfile(os.path.join(ROOT, words[1]))
        elif words[:1] in (["pytest"], ["bash"]):
            path = next((w for w in words[1:] if not w.startswith("-")), None)
            assert path is None or os.path.exists(os.path.join(ROOT, path)), f"{name}:{line}: {path}"
        else:
            pytest.fail(f"{name}:{line}: a command the docs test does not know: {command!r}")


def test_readme_is_short_and_holds_the_ci_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.split("\n")) <= 220
    assert re.search(r"<!-- ci-test -->\n```\n.+\n```\n<!-- /ci-test -->", text)


def test_docs_carry_no_run_names():
    pattern = re.compile(r"\bruns? [A-Z]{1,2}[0-9]?\b|NOTES(\.md)? ?(section )?[0-9]|\blent (H200|GPU|machine)|[$]OUT")
    for name in ("README.md", "docs/design.md", "docs/numerics.md", "docs/performance.md"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            hits = [line for line in f if pattern.search(line)]
        assert not hits, f"{name}: {hits[:3]}"
    assert sys.version_info >= (3, 10)


def test_gpu_check_remakes_every_report_as_published():
    """scripts/gpu_check.sh's report_command has each committed report, with the sub-command and
    options docs/performance.md publishes for it, and REPORTS=1 makes all of them by default."""
    with open(os.path.join(ROOT, "scripts", "gpu_check.sh"), encoding="utf-8") as f:
        script = f.read()
    commands = dict(re.findall(r'^\s+(\w+)\)\s+echo "([^"]*)" ;;$', script, re.M))
    defaults = re.search(r'REPORT_NAMES:-([\w ]+)\}', script).group(1).split()
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
        published = f.read()
    committed = {n[:-5] for n in os.listdir(os.path.join(ROOT, "benchmarks", "results")) if n.endswith(".json")}
    assert committed <= set(commands) and set(defaults) == set(commands), (committed, commands, defaults)
    for name, command in commands.items():
        command = command.replace("$flashinfer", "").strip()
        # the whole option list: followed by the output options or the line's end
        assert re.search(rf"python -m cupy_rmsnorm\.bench {re.escape(command)}( --out| --name|$)", published, re.M), \
            (name, command)
