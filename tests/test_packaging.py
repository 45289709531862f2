"""Packaging: the wheel installed as a user would install it, beside Hugging Face's `kernels`; where the workspace is.

The wheel tests build this project's wheel in a fresh virtual environment, install it (not editable) together with
Hugging Face's `kernels` from the package index, and check that the two packages keep their own files, that the
console script runs, and that the kernel sources a user edits live in a per-user workspace outside site-packages.
They need pip to reach a package index: without one they are skipped, except in CI (CI, or MONOKERNEL_REQUIRE_INDEX
set), where that is a failure. The other tests run offline, in this process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from workbench import paths

REPO = paths.ROOT
DIST = "monokernel-workbench"


def _repo_sources() -> set[str]:
    """The kernel sources of the repository, relative to kernels/ (the edit history left out): a numba variant's .py
    included."""
    kdir = REPO / "kernels"
    return {p.relative_to(kdir).as_posix() for pattern in ("*.cuh", "*.ptx", "*@numba*.py") for p in kdir.rglob(pattern)
            if ".history" not in p.parts}


# ---- offline: the source checkout and the workspace rules ---------------------------------------------------------

@pytest.fixture
def default_paths(monkeypatch):
    """No override and no environment variable in force, whatever the caller set; restored afterwards."""
    monkeypatch.delenv(paths.ENV_KERNELS, raising=False)
    monkeypatch.setattr(paths, "_override", None)
    monkeypatch.setattr(paths, "_filled", set())


def test_checkout_edits_repository_kernels(default_paths):
    assert paths.source_checkout()
    assert paths.kernels_dir() == REPO / "kernels"
    assert paths.history_dir() == REPO / "kernels" / ".history"


def test_one_top_level_package():
    """kernels/ is installed as data under workbench/, never as the import package `kernels` (Hugging Face's)."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {name.split(".")[0] for name in cfg["packages"]} == {"workbench"}
    assert cfg["package-dir"] == {"workbench._kernels": "kernels"}


def test_environment_workspace_filled_once(default_paths, monkeypatch, tmp_path, capsys):
    ws = tmp_path / "ws"
    monkeypatch.setenv(paths.ENV_KERNELS, str(ws))
    assert paths.kernels_dir() == ws.resolve()
    assert {p.relative_to(ws).as_posix() for p in ws.rglob("*") if p.is_file()} == _repo_sources()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ws.resolve()) in err
    (ws / "monokernel.cuh").write_text("// edited\n")
    monkeypatch.setattr(paths, "_filled", set())            # as in a new process: an edited workspace is kept
    assert paths.kernels_dir() == ws.resolve()
    assert (ws / "monokernel.cuh").read_text() == "// edited\n"
    assert capsys.readouterr().err == ""


def test_folder_with_other_content_is_left_alone(default_paths, monkeypatch, tmp_path, capsys):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("mine\n")
    monkeypatch.setenv(paths.ENV_KERNELS, str(ws))
    assert paths.kernels_dir() == ws.resolve()
    assert [p.name for p in ws.iterdir()] == ["notes.txt"]
    assert capsys.readouterr().err == ""


def test_user_workspace_location(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert paths.user_workspace() == (tmp_path / "data" / DIST / "kernels").resolve()
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.user_workspace() == (tmp_path / "home" / ".local" / "share" / DIST / "kernels").resolve()


# ---- the wheel, installed (needs a package index) -----------------------------------------------------------------

_EVERYWHERE = shutil.ignore_patterns("__pycache__", ".history", "*.egg-info", ".pytest_cache", ".ipynb_checkpoints")


def _ignore(folder: str, names: list[str]) -> set[str]:
    """What a copy of the checkout leaves out: git, the venv, build outputs (top level only: workbench/compiler stays)."""
    top = {".git", ".venv", "build", "dist", "out"} if Path(folder) == REPO else set()
    return set(_EVERYWHERE(folder, names)) | (top & set(names))


def _index_required() -> bool:
    return any(os.environ.get(v, "").lower() not in ("", "0", "false") for v in ("CI", "MONOKERNEL_REQUIRE_INDEX"))


def _run(cmd, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (f"{' '.join(proc.args)} -> {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


class Installed:
    def __init__(self, root: Path, venv: Path, wheel: Path):
        self.root, self.venv, self.wheel = root, venv, wheel
        self.bin = venv / ("Scripts" if os.name == "nt" else "bin")
        self.python = self.bin / "python"

    @staticmethod
    def pip_env() -> dict:
        """pip keeps the caller's settings (index, certificates, cache), not the caller's Python paths."""
        return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}

    def env(self, **extra) -> dict:
        """A user's environment: home and data folders in the test's tmp folder, no workspace or path settings."""
        env = {k: v for k, v in self.pip_env().items() if k not in (paths.ENV_KERNELS, "XDG_DATA_HOME")}
        env.update(HOME=str(self.root / "home"), XDG_DATA_HOME=str(self.root / "data"))
        env.update(extra)
        return {k: v for k, v in env.items() if v is not None}

    def python_json(self, code: str, **extra) -> tuple[dict, str]:
        proc = _check(_run([self.python, "-c", textwrap.dedent(code)], env=self.env(**extra), cwd=self.root))
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "venv"
    _check(_run([sys.executable, "-m", "venv", venv]))
    inst = Installed(root, venv, root)
    pip = [inst.python, "-m", "pip", "--disable-pip-version-check"]

    # Hugging Face's kernels first, alone: this is the probe for a reachable index
    house = root / "wheelhouse"
    probe = _run([*pip, "download", "--no-deps", "--retries", "1", "--timeout", "20", "-d", house, "kernels"],
                 env=inst.pip_env(), timeout=180)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        reason = f"pip cannot reach a package index (Hugging Face's `kernels` could not be fetched): {last}"
        if _index_required():
            pytest.fail(reason + " — in CI the index must be reachable")
        pytest.skip(reason)

    src = root / "src"                                       # a copy: the build writes build/ and *.egg-info
    shutil.copytree(REPO, src, ignore=_ignore)
    dist = root / "dist"
    _check(_run([*pip, "wheel", "--no-deps", "-w", dist, src], env=inst.pip_env()))
    (wheel,) = dist.glob("*.whl")
    inst.wheel = wheel

    hf = next(house.glob("kernels-*"))
    _check(_run([*pip, "install", hf, "numpy", "tqdm", "tokenizers"], env=inst.pip_env()))
    # ours last, so that a wheel that still shipped a `kernels` package would overwrite Hugging Face's files
    _check(_run([*pip, "install", "--no-deps", wheel], env=inst.pip_env()))
    return inst


def _wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


@pytest.mark.network
def test_wheel_contents(installed):
    names = _wheel_names(installed.wheel)
    assert not [n for n in names if n.split("/")[0] == "kernels"], "a top-level kernels/ in the wheel"
    top = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    with zipfile.ZipFile(installed.wheel) as z:
        assert z.read(top).decode().split() == ["workbench"]
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert f"{DIST} = workbench.cli:main" in entry
    # the kernel sources, as data, all of them and no edit history
    shipped = {n.removeprefix("workbench/_kernels/") for n in names if n.startswith("workbench/_kernels/")}
    assert {n for n in shipped if n.endswith((".cuh", ".ptx")) or "@numba" in n} == _repo_sources()
    assert not [n for n in names if ".history" in n]
    # every module of the package is in the wheel (pyproject's package list is written out by hand)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "workbench").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - set(names) == set(), "modules missing from the wheel: add their package to pyproject.toml"


@pytest.mark.network
def test_beside_hugging_face_kernels(installed):
    info, _ = installed.python_json("""
        import importlib.metadata as md, json, sysconfig
        import kernels, workbench
        ours = [str(f) for f in md.distribution("monokernel-workbench").files if f.parts[0] == "kernels"]
        print(json.dumps({"kernels": kernels.__file__, "workbench": workbench.__file__,
                          "hf_record": str(md.distribution("kernels").locate_file("kernels/__init__.py")),
                          "hf_api": callable(getattr(kernels, "get_kernel", None)),
                          "ours_in_kernels": ours, "site": sysconfig.get_paths()["purelib"]}))
    """)
    site = Path(info["site"]).resolve()
    assert Path(info["workbench"]).resolve() == site / "workbench" / "__init__.py"
    assert Path(info["kernels"]).resolve() == site / "kernels" / "__init__.py" == Path(info["hf_record"]).resolve()
    assert info["hf_api"], "`kernels` is not Hugging Face's (no get_kernel)"
    assert info["ours_in_kernels"] == []
    assert not (site / "kernels" / "monokernel.cuh").exists()


@pytest.mark.network
def test_console_script(installed):
    proc = _check(_run([installed.bin / DIST, "--help"], env=installed.env(), cwd=installed.root, timeout=60))
    assert "generate" in proc.stdout and "build" in proc.stdout
    assert proc.stdout.startswith(f"usage: {DIST} [-h] command"), proc.stdout     # named as it was invoked


@pytest.mark.network
def test_workspace_outside_site_packages(installed):
    code = """
        import json, sys, sysconfig
        from workbench import paths
        k = paths.kernels_dir()
        print(json.dumps({"dir": str(k), "again": str(paths.kernels_dir()), "history": str(paths.history_dir()),
                          "site": sysconfig.get_paths()["purelib"], "checkout": paths.source_checkout(),
                          "files": sorted(p.relative_to(k).as_posix() for p in k.rglob("*") if p.is_file())}))
    """
    info, err = installed.python_json(code)
    site, ws = Path(info["site"]).resolve(), Path(info["dir"])
    assert not info["checkout"]
    assert ws == (installed.root / "data" / DIST / "kernels").resolve()
    assert site not in ws.parents and Path(info["history"]).parent == ws and info["again"] == info["dir"]
    assert set(info["files"]) == _repo_sources()
    assert err.count("\n") == 1 and str(ws) in err, err              # one line, once, where the workspace is

    (ws / "sections" / "embedding.cuh").write_text("// my edit\n")
    info, err = installed.python_json(code)                         # a second run keeps the edit, says nothing
    assert info["dir"] == str(ws) and err == ""
    assert (ws / "sections" / "embedding.cuh").read_text() == "// my edit\n"
    shipped = site / "workbench" / "_kernels" / "sections" / "embedding.cuh"
    assert shipped.read_text() == (REPO / "kernels" / "sections" / "embedding.cuh").read_text()

    # without XDG_DATA_HOME: under ~/.local/share
    info, err = installed.python_json(code, XDG_DATA_HOME=None)
    assert Path(info["dir"]) == (installed.root / "home" / ".local" / "share" / DIST / "kernels").resolve()
    assert set(info["files"]) == _repo_sources()
    # the environment variable wins
    info, _ = installed.python_json(code, MONOKERNEL_WORKSPACE=str(installed.root / "mine"))
    assert Path(info["dir"]) == (installed.root / "mine").resolve() and set(info["files"]) == _repo_sources()
