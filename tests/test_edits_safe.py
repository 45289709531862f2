"""No edit of a kernel section is ever lost, bytes are kept exactly, and bad inputs are one clear error.

Concurrent writers (threads, Workbench objects, processes) are counted: every text written, and the text the file
held first, must end up exactly once on disk or in the history. Section files with CRLF or mixed line endings go
through edit and undo byte for byte. A file that is not UTF-8, or a NUL, is refused naming the file and the offset;
so are a workspace that is a file, one no file can be created in, one holding no kernels, and a history folder that
is a file. Everything runs on real files in a private copy of the kernel sources; no Workbench here compiles.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from workbench import cli, paths
from workbench.compiler import assemble
from workbench.errors import SourceError, UserError
from workbench.loop import sections, session
from workbench.model.config import get_config

SECTION = "embedding"


def copy_kernels(dest: Path) -> Path:
    new = dest / "kernels"
    shutil.copytree(paths.template_dir(), new, ignore=shutil.ignore_patterns(".history", "__pycache__", "*.pyc"))
    return new.resolve()


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A private copy of the kernel sources that everything in this process reads and writes."""
    new = copy_kernels(tmp_path)
    monkeypatch.setattr(paths, "_override", new)
    monkeypatch.setattr(session, "_ACTIVE", None)
    return new


@pytest.fixture
def env_workspace(monkeypatch):
    """The workspace chosen by $MONOKERNEL_WORKSPACE alone, checked afresh as in a new process."""
    monkeypatch.setattr(paths, "_override", None)
    monkeypatch.setattr(paths, "_filled", set())

    def use(folder: Path | str):
        monkeypatch.setenv(paths.ENV_KERNELS, str(folder))
    return use


def cpu_workbench(**kw) -> session.Workbench:
    """A CPU-mode Workbench that edits and undoes only: never built, so nothing is compiled."""
    return session.Workbench("tiny", device="cpu", build=False, activate=False, **kw)


def versions(path: Path, history: Path) -> Counter:
    """Every version kept: the file on disk, the undo stack and the undone entries (refused edits are not versions
    that were on disk)."""
    found = Counter()
    if path.exists():
        found[path.read_bytes()] += 1
    if history.is_dir():
        for p in history.iterdir():
            if p.name.endswith(".absent"):
                found[b""] += 1
            elif p.name.endswith(".cuh") and not p.name.endswith(".refused.cuh"):
                found[p.read_bytes()] += 1
    return found


def assert_each_version_once(path: Path, history: Path, original: bytes, texts: list[str]):
    """The file's first text and every text written are kept, on disk or in the history, exactly once each."""
    want = Counter({original: 1})
    want.update(t.encode() for t in texts)
    got = versions(path, history)
    lost, doubled = want - got, got - want
    assert (len(lost), len(doubled)) == (0, 0), (f"{len(lost)} of {len(want)} versions lost, {len(doubled)} kept "
                                                 f"twice, e.g. {sorted(lost)[:2]} / {sorted(doubled)[:2]}")


# ---- concurrent writers ---------------------------------------------------------------------------------------------

def run_threads(jobs):
    """Start every job at once (a barrier), join them, and re-raise the first failure."""
    gate, errors = threading.Barrier(len(jobs)), []

    def wrap(job):
        try:
            gate.wait()
            job()
        except BaseException as e:                   # noqa: BLE001 - handed to the test below
            errors.append(e)
    threads = [threading.Thread(target=wrap, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]


def test_threads_writing_one_section_lose_no_version(kernels):
    path = sections.section_file(SECTION)
    original = path.read_bytes()
    texts = {w: [f"// thread {w} version {i}\n" + "x" * (i * 37 % 500) + "\n" for i in range(20)] for w in range(4)}
    run_threads([lambda w=w: [sections.write_section(SECTION, t) for t in texts[w]] for w in texts])
    written = [t for ts in texts.values() for t in ts]
    assert_each_version_once(path, kernels / ".history" / SECTION, original, written)
    assert len(sections.section_history(SECTION)) == 80              # one entry per write, none doubled


def test_two_workbenches_in_threads_lose_no_version(kernels):
    a, b = cpu_workbench(), cpu_workbench()
    path = sections.section_file(SECTION)
    original = path.read_bytes()
    texts = {wb: [f"// workbench {n} edit {i}\n" for i in range(40)] for n, wb in enumerate((a, b))}
    run_threads([lambda wb=wb: [wb.edit(SECTION, t) for t in texts[wb]] for wb in texts])
    written = [t for ts in texts.values() for t in ts]
    assert_each_version_once(path, kernels / ".history" / SECTION, original, written)
    assert len(a.section_history(SECTION)) == len(b.section_history(SECTION)) == 80


def test_edits_and_undos_in_threads_keep_every_version_exactly_once(kernels):
    path = sections.section_file(SECTION)
    original = path.read_bytes()
    texts = {w: [f"// writer {w} text {i}\n" for i in range(25)] for w in range(2)}
    undone = []

    def undoer():
        for _ in range(30):
            try:
                undone.append(sections.undo_section(SECTION))
            except LookupError:
                time.sleep(0.001)
    run_threads([*(lambda w=w: [sections.write_section(SECTION, t) for t in texts[w]] for w in texts), undoer])
    written = [t for ts in texts.values() for t in ts]
    assert undone                                                      # the undos did run among the writes
    assert_each_version_once(path, kernels / ".history" / SECTION, original, written)


CHILD = r"""
import sys, time
from pathlib import Path
from workbench import paths
kernels, who, n, gate, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
paths.set_kernels_dir(kernels)
if mode == "workbench":
    from workbench.loop.session import Workbench
    wb = Workbench("tiny", device="cpu", build=False, activate=False)
    write = lambda text: wb.edit("embedding", text)
else:
    from workbench.loop.sections import write_section
    write = lambda text: write_section("embedding", text)
Path(f"{gate}.{who}").touch()
while not gate.exists():
    time.sleep(0.001)
for i in range(n):
    write(f"// process {who} version {i}\n")
"""


def run_two_processes(kernels: Path, tmp_path: Path, mode: str, n: int) -> list[str]:
    """Two processes writing `n` versions each, released together once both are ready; their texts."""
    gate = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(kernels), who, str(n), str(gate), mode],
                              cwd=paths.ROOT, stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    deadline = time.monotonic() + 60
    while not all(Path(f"{gate}.{who}").exists() for who in ("a", "b")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer did not start"
        time.sleep(0.01)
    gate.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    return [f"// process {who} version {i}\n" for who in ("a", "b") for i in range(n)]


def test_two_processes_without_a_workbench_lose_no_version(kernels, tmp_path):
    path = sections.section_file(SECTION)
    original = path.read_bytes()
    written = run_two_processes(kernels, tmp_path, "sections", 60)
    assert_each_version_once(path, kernels / ".history" / SECTION, original, written)
    assert len(sections.section_history(SECTION)) == 120


def test_two_processes_each_with_its_own_workbench_lose_no_version(kernels, tmp_path):
    path = sections.section_file(SECTION)
    original = path.read_bytes()
    written = run_two_processes(kernels, tmp_path, "workbench", 40)
    assert_each_version_once(path, kernels / ".history" / SECTION, original, written)
    stack = sections.section_history(SECTION)
    assert len(stack) == 80 and stack[0].read_bytes() == original


def test_the_lock_lives_in_the_kernels_history_whatever_history_dir_is(kernels, tmp_path):
    hist = tmp_path / "elsewhere"
    wb = cpu_workbench(history_dir=hist)
    wb.edit(SECTION, "// one\n")
    assert (kernels / ".history" / sections.LOCK_NAME).is_file()        # two histories, one lock per kernels folder
    assert [p.parent for p in wb.section_history(SECTION)] == [hist / SECTION]
    assert sections.section_history(SECTION) == []


# ---- base=: an edit made on a text that has changed since is refused, and kept -----------------------------------

def test_edit_based_on_a_changed_text_is_refused_and_kept(kernels):
    path = sections.section_file(SECTION)
    read = path.read_text(encoding="utf-8")
    sections.write_section(SECTION, read + "// someone else's edit\n")
    theirs = path.read_bytes()
    mine = read + "// my edit\n"
    with pytest.raises(SourceError) as err:
        sections.write_section(SECTION, mine, base=read)
    kept = err.value.kept
    msg = str(err.value)
    assert msg.startswith("kernels/sections/embedding.cuh changed since the text your edit is based on was read")
    assert "your edit was not written" in msg and f"is kept in {sections.display_path(kept)}" in msg
    assert "refuses rather than merges" in msg and "\n" not in msg
    assert kept.parent == kernels / ".history" / SECTION and kept.name.endswith(".refused.cuh")
    assert kept.read_bytes() == mine.encode()                            # the user's text, not lost
    assert path.read_bytes() == theirs                                   # theirs, not overwritten
    assert kept not in sections.section_history(SECTION)                 # not a version to undo to
    assert isinstance(err.value, UserError)


def test_edit_based_on_the_current_text_is_written(kernels):
    path = sections.section_file(SECTION)
    read = path.read_text(encoding="utf-8")
    entry = sections.write_section(SECTION, read + "// mine\n", base=read)
    assert path.read_text(encoding="utf-8") == read + "// mine\n" and entry.read_text(encoding="utf-8") == read
    new = sections.section_file(SECTION, "fresh")
    sections.write_section(SECTION, "// new variant\n", "fresh", base="")     # a missing file counts as ""
    assert new.read_text(encoding="utf-8") == "// new variant\n"


def test_two_workbenches_editing_from_one_read_the_second_is_refused(kernels):
    a, b = cpu_workbench(), cpu_workbench()
    path = sections.section_file(SECTION)
    read = path.read_text(encoding="utf-8")
    a.edit(SECTION, read + "// from a\n", base=read)
    with pytest.raises(SourceError, match=r"kernels/sections/embedding\.cuh changed since .* was not written") as err:
        b.edit(SECTION, read + "// from b\n", base=read)
    assert path.read_text(encoding="utf-8") == read + "// from a\n"
    assert err.value.kept.read_text(encoding="utf-8") == read + "// from b\n"
    assert [e.read_text(encoding="utf-8") for e in b.section_history(SECTION)] == [read]


def test_base_is_compared_exactly_line_endings_included(kernels):
    path = sections.section_file(SECTION)
    path.write_bytes(b"// one\r\n// two\r\n")
    with pytest.raises(SourceError, match="changed since"):
        sections.write_section(SECTION, "// three\n", base="// one\n// two\n")   # read with newline translation
    assert path.read_bytes() == b"// one\r\n// two\r\n"
    sections.write_section(SECTION, "// three\n", base="// one\r\n// two\r\n")
    assert path.read_bytes() == b"// three\n"


# ---- bytes are kept exactly ---------------------------------------------------------------------------------------

def test_crlf_round_trips_through_edit_and_undo_byte_for_byte(kernels):
    path = sections.section_file(SECTION)
    crlf = path.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    sections.write_section(SECTION, crlf.decode())
    assert path.read_bytes() == crlf
    sections.write_section(SECTION, crlf.decode() + "// more\r\n")
    sections.undo_section(SECTION)
    assert path.read_bytes() == crlf                                     # not LF: the entry was read as bytes
    undone = list((kernels / ".history" / SECTION).glob("*.undone.cuh"))
    assert [p.read_bytes() for p in undone] == [crlf + b"// more\r\n"]


def test_lf_edit_of_a_crlf_file_is_written(kernels):
    path = sections.section_file(SECTION)
    path.write_bytes(b"// a\r\n// b\r\n")
    entry = sections.write_section(SECTION, "// a\n// b\n")
    assert entry is not None and path.read_bytes() == b"// a\n// b\n"
    assert entry.read_bytes() == b"// a\r\n// b\r\n"
    assert sections.write_section(SECTION, "// a\n// b\n") is None      # the same bytes: nothing to write


def test_mixed_line_endings_are_kept(kernels):
    path = sections.section_file(SECTION)
    mixed = "// unix\n// dos\r\n// old mac\r// end"
    sections.write_section(SECTION, mixed)
    assert path.read_bytes() == mixed.encode()
    sections.write_section(SECTION, mixed.replace("\r", ""))
    assert path.read_bytes() == b"// unix\n// dos\n// old mac// end"
    sections.undo_section(SECTION)
    assert path.read_bytes() == mixed.encode()


def test_crlf_through_a_workbench_edit_and_undo(kernels):
    wb = cpu_workbench()
    path = sections.section_file("lm_head")
    before = path.read_bytes()
    crlf = before.decode().replace("\n", "\r\n")
    wb.edit("lm_head", crlf)
    wb.edit("lm_head", crlf + "// x\r\n")
    wb.undo("lm_head", reload=False)
    assert path.read_bytes() == crlf.encode()
    wb.undo("lm_head", reload=False)
    assert path.read_bytes() == before


def test_a_crlf_section_assembles_as_its_lf_twin(kernels):
    cfg = get_config("tiny")
    lf = assemble.assemble(cfg)
    path = sections.section_file(SECTION)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert assemble.assemble(cfg).source == lf.source


# ---- not UTF-8, NUL -----------------------------------------------------------------------------------------------

def latin1(path: Path) -> int:
    """Write a Latin-1 'é' into a comment of `path`; the byte offset of it."""
    data = path.read_bytes()
    head = b"// caf"
    path.write_bytes(head + b"\xe9 au lait\n" + data)
    return len(head)


def test_latin1_section_is_refused_in_assembly_naming_the_file_and_offset(kernels):
    at = latin1(sections.section_file(SECTION))
    with pytest.raises(SourceError) as err:
        assemble.assemble(get_config("tiny"))
    assert str(err.value) == (f"kernels/sections/embedding.cuh is not UTF-8: byte 0xe9 at offset {at} (line 1: "
                              f"invalid continuation byte): kernel sources are read as UTF-8 only, convert it (from "
                              f"Latin-1: iconv -f latin1 -t utf-8)")


def test_latin1_portability_header_is_refused_in_assembly(kernels):
    at = latin1(kernels / "portability.cuh")
    with pytest.raises(SourceError, match=rf"^kernels/portability\.cuh is not UTF-8: byte 0xe9 at offset {at} "):
        assemble.assemble(get_config("tiny"))


def test_latin1_section_is_refused_by_edit_and_undo(kernels):
    path = sections.section_file(SECTION)
    sections.write_section(SECTION, path.read_text(encoding="utf-8") + "// an edit to undo\n")
    at = latin1(path)
    on_disk = path.read_bytes()
    stack = sections.section_history(SECTION)
    for attempt in (lambda: sections.write_section(SECTION, "// fixed\n"), lambda: sections.undo_section(SECTION)):
        with pytest.raises(SourceError) as err:
            attempt()
        assert str(err.value).startswith(f"kernels/sections/embedding.cuh is not UTF-8: byte 0xe9 at offset {at} "
                                         f"(line 1: invalid continuation byte); nothing was written: ")
    assert path.read_bytes() == on_disk and sections.section_history(SECTION) == stack


def test_latin1_history_entry_is_refused_by_undo(kernels):
    path = sections.section_file(SECTION)
    entry = sections.write_section(SECTION, "// now\n")
    entry.write_bytes(b"// \xe9t\xe9\n")
    with pytest.raises(SourceError) as err:
        sections.undo_section(SECTION)
    assert str(err.value).startswith(f"{sections.display_path(entry)} (the version of kernels/sections/embedding.cuh "
                                     f"to restore) is not UTF-8: byte 0xe9 at offset 3 (line 1: ")
    assert "nothing was restored" in str(err.value)
    assert path.read_bytes() == b"// now\n" and sections.section_history(SECTION) == [entry]


def test_latin1_section_is_an_assemble_error_of_the_workbench_naming_the_file(kernels):
    wb = cpu_workbench()
    latin1(sections.section_file("lm_head"))
    rec = wb.reload()                                    # refused while assembling: nothing reaches the compiler
    assert rec.status == session.ASSEMBLE_ERROR
    assert rec.error.startswith("SourceError: kernels/sections/lm_head.cuh is not UTF-8: byte 0xe9 at offset 6 ")


def test_nul_in_an_edit_is_refused_before_anything_is_written(kernels):
    path = sections.section_file(SECTION)
    before = path.read_bytes()
    with pytest.raises(SourceError) as err:
        sections.write_section(SECTION, "// fine\n// not\0fine\n")
    assert str(err.value) == ("section embedding: the text for kernels/sections/embedding.cuh holds a NUL character "
                              "at position 14 (line 2, column 7); nothing was written: kernel sources are text, "
                              "remove it")
    assert path.read_bytes() == before
    assert not (kernels / ".history" / SECTION).exists()                 # no history entry, not even its folder


def test_nul_in_a_workbench_edit_of_a_variant_names_the_variant(kernels):
    wb = cpu_workbench()
    with pytest.raises(SourceError, match=r"^section embedding@v2: the text for kernels/sections/embedding@v2\.cuh "
                                          r"holds a NUL character at position 0 \(line 1, column 1\)"):
        wb.edit(SECTION, "\0", "v2")
    assert not sections.section_file(SECTION, "v2").exists() and wb.section_history(SECTION, "v2") == []


def test_a_lone_surrogate_in_an_edit_is_refused(kernels):
    path = sections.section_file(SECTION)
    before = path.read_bytes()
    text = b"// caf\xe9\n".decode("utf-8", "surrogateescape")
    with pytest.raises(SourceError, match=r"is not UTF-8 text: '\\udce9' at position 6 \(line 1, column 7\)"):
        sections.write_section(SECTION, text)
    assert path.read_bytes() == before


def test_nul_in_a_file_on_disk_is_refused_in_assembly_and_edit(kernels):
    path = sections.section_file("lm_head")
    data = path.read_bytes()
    path.write_bytes(data[:10] + b"\0" + data[10:])
    line = data[:10].count(b"\n") + 1
    with pytest.raises(SourceError) as err:
        assemble.assemble(get_config("tiny"))
    assert str(err.value) == (f"kernels/sections/lm_head.cuh holds a NUL byte at offset 10 (line {line}): kernel "
                              f"sources are text, remove it")
    with pytest.raises(SourceError, match=rf"lm_head\.cuh holds a NUL byte at offset 10 \(line {line}\); nothing "):
        sections.write_section("lm_head", "// replacement\n")


# ---- the workspace and the history folder -------------------------------------------------------------------------

def test_workspace_that_is_a_regular_file(env_workspace, tmp_path):
    f = tmp_path / "ws.txt"
    f.write_text("not a folder\n")
    env_workspace(f)
    with pytest.raises(SourceError) as err:
        paths.kernels_dir()
    assert str(err.value) == (f"MONOKERNEL_WORKSPACE={f} is a file, not a folder: set MONOKERNEL_WORKSPACE to a "
                              f"folder holding the kernel sources, or to a new or empty folder (it gets a copy of "
                              f"them)")
    assert f.read_text() == "not a folder\n"


def test_workspace_under_a_regular_file(env_workspace, tmp_path):
    f = tmp_path / "ws.txt"
    f.write_text("x")
    env_workspace(f / "kernels")
    with pytest.raises(SourceError, match=rf"^MONOKERNEL_WORKSPACE={f}/kernels: the kernel sources cannot be "
                                          rf"copied there \({f} is a file, not a folder\): set MONOKERNEL_"):
        paths.kernels_dir()


def test_workspace_errors_are_one_line_on_the_command_line(env_workspace, tmp_path, capsys):
    f = tmp_path / "ws.txt"
    f.write_text("x")
    env_workspace(f)
    assert cli.main(["build", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: MONOKERNEL_WORKSPACE={f} is a file, not a folder: ") and err.count("\n") == 1


UNWRITABLE = r"""
import json, os, sys
from workbench import paths
from workbench.errors import SourceError
ws = sys.argv[1]
try:
    open(os.path.join(ws, "probe"), "w").close()
except OSError:
    pass
else:
    os.unlink(os.path.join(ws, "probe"))
    print(json.dumps({"writable": True}))
    sys.exit()
os.environ["MONOKERNEL_WORKSPACE"] = ws
try:
    paths.kernels_dir()
    print(json.dumps({"writable": False, "error": None}))
except SourceError as e:
    print(json.dumps({"writable": False, "error": str(e)}))
"""


def _as_if_not_root():
    """In the child before exec: take from the bounding set what lets root write past mode bits (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER), so the exec'd root process is held to them like any other user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:           # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_workspace_that_is_not_writable(tmp_path):
    """A filled workspace whose folder is mode 0555. Root ignores mode bits, so as root the check runs in a child
    whose bounding set lacks the capabilities that let it (a real process, a real attempt to create a file); where
    those cannot be dropped the test is skipped, saying why. The child first proves it cannot write there itself."""
    ws = copy_kernels(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != paths.ENV_KERNELS}
    ws.chmod(0o555)
    try:
        try:
            r = subprocess.run([sys.executable, "-c", UNWRITABLE, str(ws)], cwd=paths.ROOT, env=env, text=True,
                               capture_output=True, timeout=120,
                               preexec_fn=_as_if_not_root if os.geteuid() == 0 else None)
        except subprocess.SubprocessError as e:
            pytest.skip(f"running as root, and the capabilities that let root write anywhere cannot be dropped: {e}")
    finally:
        ws.chmod(0o755)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if out["writable"]:
        pytest.skip("this process can create files in a mode-0555 folder: no unwritable folder to test with")
    assert out["error"] == (f"MONOKERNEL_WORKSPACE={ws} is not writable (Permission denied): edits and their history "
                            f"are written there; make it writable, or set MONOKERNEL_WORKSPACE to a folder holding "
                            f"the kernel sources, or to a new or empty folder (it gets a copy of them)")


def test_workspace_holding_no_kernels_is_refused_when_used_and_left_alone(env_workspace, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("mine\n")
    env_workspace(ws)
    assert paths.kernels_dir() == ws.resolve()                     # named, never written to
    message = (f"MONOKERNEL_WORKSPACE={ws} holds no kernel sources (no portability.cuh, monokernel.cuh or sections/; "
               f"its other files are left alone): set MONOKERNEL_WORKSPACE to a folder holding the kernel sources, "
               f"or to a new or empty folder (it gets a copy of them)")
    for use in (lambda: assemble.assemble(get_config("tiny")), lambda: sections.write_section("monokernel", "// x\n"),
                lambda: sections.undo_section(SECTION)):
        with pytest.raises(SourceError) as err:
            use()
        assert str(err.value) == message
    assert [p.name for p in ws.iterdir()] == ["notes.txt"]


def test_workspace_missing_part_of_the_kernels_names_what_is_missing(kernels):
    shutil.rmtree(kernels / "sections")
    (kernels / "monokernel.cuh").unlink()
    with pytest.raises(SourceError) as err:
        assemble.assemble(get_config("tiny"))
    assert str(err.value) == (f"the kernels folder {kernels} (set_kernels_dir / use_kernels_dir) lacks monokernel.cuh, "
                              f"sections/ of the kernel sources: put them back, or give set_kernels_dir a folder "
                              f"holding the kernel sources")


def test_an_empty_workspace_is_still_filled(env_workspace, tmp_path, capsys):
    ws = tmp_path / "empty"
    ws.mkdir()
    env_workspace(ws)
    assert paths.kernels_dir() == ws.resolve()
    assert (ws / "portability.cuh").is_file() and (ws / "sections" / "embedding.cuh").is_file()
    assert not [p for p in ws.iterdir() if p.name.startswith(".write-check")]   # the probe is gone
    assert "kernel sources copied to" in capsys.readouterr().err
    assert sections.write_section(SECTION, "// edited\n") is not None


def test_history_dir_that_is_a_file_is_refused_by_the_workbench(kernels, tmp_path):
    f = tmp_path / "history.txt"
    f.write_text("x")
    with pytest.raises(SourceError) as err:
        cpu_workbench(history_dir=f)
    assert str(err.value) == (f"history_dir={f}: it is a file, not a folder: give history_dir a folder for the edit "
                              f"history (it is created if missing), or leave it out to keep the history in "
                              f"kernels/.history")
    with pytest.raises(SourceError, match=rf"^history_dir={f}/sub: {f} is a file, not a folder: "):
        cpu_workbench(history_dir=f / "sub")


def test_history_dir_that_becomes_a_file_refuses_the_edit(kernels, tmp_path):
    hist = tmp_path / "hist"
    wb = cpu_workbench(history_dir=hist)
    hist.write_text("x")                                   # after the Workbench was made
    path = sections.section_file(SECTION)
    before = path.read_bytes()
    with pytest.raises(SourceError) as err:
        wb.edit(SECTION, "// x\n")
    assert str(err.value) == (f"the edit history cannot be kept in {hist}/embedding: {hist} is a file, not a folder; "
                              f"nothing was written: move that file aside (a Workbench's history_dir picks another "
                              f"folder)")
    assert path.read_bytes() == before


def test_default_history_that_is_a_file_refuses_the_edit(kernels):
    (kernels / ".history").write_text("x")
    path = sections.section_file(SECTION)
    before = path.read_bytes()
    with pytest.raises(SourceError, match=r"^the edit history cannot be kept in kernels/\.history: .*kernels/"
                                          r"\.history is a file, not a folder; nothing was written"):
        sections.write_section(SECTION, "// x\n")
    assert path.read_bytes() == before


def test_source_errors_are_user_errors_and_cross_processes():
    import pickle
    e = pickle.loads(pickle.dumps(SourceError("m", path="p", kept="k")))
    assert isinstance(e, UserError) and isinstance(e, ValueError) and (str(e), e.path, e.kept) == ("m", "p", "k")
