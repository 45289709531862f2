"""What a newcomer reads from the command line before anything runs: every option explained, the command named as
it was typed, the plan's counts in plain English, `trace` among the subcommands, and on a machine without a GPU one
sentence naming what runs without one (each of which does run here)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from workbench import cli, paths
from workbench.compiler import compile as C
from workbench.compiler import nvrtc
from workbench.measure import trace

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "fixtures" / "timing_h200_llama-3.2-1b_pos0.npz"


def run_cli(*argv, timeout=120, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- help texts ------------------------------------------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser, path=()):
    """(the words that reach it, its parser) for the parser and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name))


def unexplained(parser: argparse.ArgumentParser) -> list[str]:
    """Every option, positional and subcommand under `parser` without help text, as `command --option`."""
    missing = []
    for path, p in subcommands(parser):
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                missing += [" ".join((*path, c.dest)) for c in action._choices_actions if not (c.help or "").strip()]
            elif not (action.help or "").strip():
                missing.append(" ".join((*path, "/".join(action.option_strings) or action.dest)))
    return missing


def test_every_option_of_every_subcommand_has_help():
    assert unexplained(cli._parser()) == []


def test_the_walker_finds_an_option_without_help():
    """The check above can fail: an option without help, deep in a subcommand, is named."""
    ap = cli._parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["plan"].add_argument("--quiet", action="store_true")
    tsub = next(a for a in sub.choices["trace"]._actions if isinstance(a, argparse._SubParsersAction))
    tsub.choices["info"].add_argument("--as-json", help="  ")
    assert unexplained(ap) == ["plan --quiet", "trace info --as-json"]


# -- the command's own name ------------------------------------------------------------------------------------------

def test_the_module_names_itself_as_typed():
    r = run_cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m workbench [-h] command ..."), r.stdout
    assert run_cli("plan", "--bogus").stderr == ("error: unrecognized arguments: --bogus (see python -m workbench "
                                                 "--help)\n")


def test_the_console_script_names_itself():
    """`monokernel-workbench --help`, as the entry point pyproject.toml declares runs it: main() with sys.argv[0]
    the script's path."""
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert script == {"monokernel-workbench": "workbench.cli:main"}
    code = ("import sys; sys.argv[0] = '/somewhere/bin/monokernel-workbench'; from workbench.cli import main; "
            "sys.exit(main())")
    for argv, stream in ((["--help"], "stdout"), (["plan", "--bogus"], "stderr")):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        text = getattr(r, stream)
        assert "monokernel-workbench" in text and "python -m workbench" not in text, text


@pytest.mark.parametrize("argv0, prog", [
    ("/venv/bin/monokernel-workbench", "monokernel-workbench"),
    (r"C:\venv\Scripts\monokernel-workbench.exe".replace("\\", "/"), "monokernel-workbench"),
    ("/repo/workbench/__main__.py", "python -m workbench"),
    ("/repo/workbench/cli.py", "python -m workbench"),
    ("-c", "python -m workbench"),
    ("", "python -m workbench"),
])
def test_invoked_as(argv0, prog):
    assert cli.invoked_as(argv0) == prog


# -- plan's counts ---------------------------------------------------------------------------------------------------

def test_plan_counts_in_plain_english(capsys):
    assert cli.main(["plan", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "; 1 unit (the whole row)" in out and "; 1,003 units (a vocabulary row)" in out
    assert not re.search(r"\b1 (units|stages|grid barriers)\b", out), out
    assert re.search(r"decode step of tiny: \d+ stages, \d+ grid barriers per token", out)


# -- trace, a subcommand ---------------------------------------------------------------------------------------------

def test_trace_is_a_subcommand_that_gives_what_the_module_gives():
    sub = run_cli("trace", "info", RECORDED)
    module = subprocess.run([sys.executable, "-m", "workbench.measure.trace", "info", str(RECORDED)],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert sub.returncode == module.returncode == 0, sub.stderr + module.stderr
    assert sub.stdout == module.stdout and "per step" in sub.stdout
    bad = run_cli("trace", "perfetto", RECORDED, "out.json", "--steps", "x-y")
    assert (bad.returncode, bad.stderr) == (2, "error: --steps 'x-y': give N or A-B (e.g. 1 or 1-2)\n")


def test_trace_perfetto_writes_through_the_subcommand(tmp_path):
    r = run_cli("trace", "perfetto", RECORDED, tmp_path / "t.json", "--steps", "1")
    assert r.returncode == 0 and (tmp_path / "t.json").stat().st_size > 0, r.stderr


def _signature(parser: argparse.ArgumentParser) -> dict:
    """Each subcommand's options as the parsing sees them (not their help)."""
    out = {}
    for path, p in subcommands(parser):
        out[path] = sorted((tuple(a.option_strings), a.dest, a.nargs, a.default, a.required, getattr(a, "type", None),
                            type(a).__name__) for a in p._actions
                           if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)))
    return out


def test_the_trace_subcommand_parses_as_the_module_does(monkeypatch):
    """main hands `trace`'s arguments to the module's own command line: the copy in cli.py must accept exactly
    what that one accepts, with the same types and defaults."""
    built = []

    def capture(self, *a, **kw):
        built.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        trace._main(["info", "x"])
    monkeypatch.undo()
    ap = cli._parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert _signature(sub.choices["trace"]) == _signature(built[0])


# -- no GPU ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    """A machine with no NVIDIA GPU, as this one may or may not be: CUDA fails, no device files."""
    monkeypatch.setattr(cli, "nvidia_gpu_present", lambda: False)
    monkeypatch.setattr(cli, "gpu_problem", lambda: "and this machine has none")


def test_no_gpu_is_one_sentence_naming_what_runs_without_one(capsys, monkeypatch, no_gpu):
    monkeypatch.chdir(ROOT)
    for cmd in ("generate", "verify", "bench", "sanitize"):
        argv = [cmd, "--model", "tiny"] + (["--no-torch"] if cmd == "bench" else [])
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(".") and err.count(". ") == 0, err
        assert err.startswith(f"error: `{cmd}` needs an NVIDIA GPU, and this machine has none; these run without "
                              "one: `python -m workbench plan`, `python -m workbench build`, "), err
        for named in (f"`python -m workbench simulate {RECORDED.relative_to(ROOT)}`",
                      f"`python -m workbench trace info {RECORDED.relative_to(ROOT)}`",
                      "the notebooks (`jupyter lab notebooks/`)", "the tests (`python -m pytest -q`)"):
            assert named in err, err
        assert "cudaError" not in err and "driver" not in err


def test_no_gpu_names_paths_from_elsewhere(capsys, monkeypatch, tmp_path, no_gpu):
    """Typed from another folder, the recorded trace and the notebooks are named where they are."""
    monkeypatch.chdir(tmp_path)
    cli.main(["generate", "--model", "tiny"])
    err = capsys.readouterr().err
    assert f"`python -m workbench trace info {RECORDED}`" in err and f"`jupyter lab {ROOT / 'notebooks'}/`" in err
    assert f"`python -m pytest -q` in {ROOT})" in err


def test_what_the_no_gpu_sentence_names_runs_here():
    """Each workbench command the sentence names runs on this machine (no GPU needed) and exits 0; the notebooks
    and the tests are run by tests/test_notebooks.py and by this suite."""
    names = cli.without_gpu(cli.MODULE_PROG)
    commands = [n.strip("`").split()[3:] for n in names if n.startswith("`python -m workbench ")]
    assert [c[0] for c in commands] == ["plan", "build", "simulate", "trace"]
    for argv in commands:
        r = run_cli(*argv, timeout=300)
        assert r.returncode == 0 and r.stdout.strip(), (argv, r.stderr)


def test_a_gpu_that_cuda_cannot_use_is_told_apart(monkeypatch):
    """With an NVIDIA GPU present, CUDA's own reason is the news (a driver to install or fix)."""
    cupy = pytest.importorskip("cupy")

    def fails():
        raise cupy.cuda.runtime.CUDARuntimeError(35)          # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", fails)
    monkeypatch.setattr(cli, "nvidia_gpu_present", lambda: True)
    why = cli.gpu_problem()
    assert why.startswith("and CUDA cannot use this machine's (cudaErrorInsufficientDriver"), why
    monkeypatch.setattr(cli, "nvidia_gpu_present", lambda: False)
    assert cli.gpu_problem() == "and this machine has none"


def test_cupy_missing_beside_a_gpu_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)                 # import cupy raises ImportError
    monkeypatch.setattr(cli, "nvidia_gpu_present", lambda: True)
    why = cli.gpu_problem()
    assert why.startswith("reached through CuPy, which cannot be imported") and paths.pip_install("cuda") in why


# -- install commands ------------------------------------------------------------------------------------------------

def test_install_commands_name_the_real_extra(monkeypatch):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "cuda" in project["optional-dependencies"]
    assert paths.pip_install("cuda") == f"pip install -e '.[cuda]' (in {paths.ROOT})"
    monkeypatch.setattr(paths, "source_checkout", lambda: False)
    assert paths.pip_install("cuda") == f"pip install '{project['name']}[cuda]'"


def test_a_build_without_cuda_bindings_says_how_to_install_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", None)
    for cubin in (True, False):
        with pytest.raises(FileNotFoundError) as e:
            nvrtc.nvrtc_program("", [], cubin=cubin)
        assert str(e.value).endswith(paths.pip_install("cuda")), e.value
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['cuda.bindings'] = None; "
                        "from workbench.cli import main; sys.exit(main(['build', '--model', 'tiny']))"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "pip install -e '.[cuda]'" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_hip_build_without_clang_says_what_to_install(monkeypatch):
    monkeypatch.delenv("WB_CLANG", raising=False)
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("apt-get install clang-19 lld-19 llvm-19")):
        C.clang_path()
    readme = (ROOT / "README.md").read_text()
    assert "apt-get install clang-19 lld-19 llvm-19" in readme


def test_a_missing_disassembler_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(C.sys, "path", [])
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(paths.pip_install("cuda"))):
        C.cuda_tool("nvdisasm")
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-nvcc"):
        C.cuda_tool("ptxas")


# -- the README's commands -------------------------------------------------------------------------------------------

def test_every_workbench_command_in_the_readme_is_a_subcommand():
    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    named = set(re.findall(r"python -m workbench (\w[\w-]*)", readme))
    assert named and named <= set(sub.choices), named - set(sub.choices)
    assert "python -m workbench." not in readme           # no module entries: they are subcommands


def test_every_script_the_readme_names_exists_and_says_why_it_is_no_subcommand():
    """The scripts are developer tools: the README says so once, and each bullet says whether it needs a GPU."""
    readme = (ROOT / "README.md").read_text()
    scripts = set(re.findall(r"python scripts/(\w+\.py)", readme))
    assert scripts and all((ROOT / "scripts" / s).is_file() for s in scripts)
    assert "not subcommands" in readme
