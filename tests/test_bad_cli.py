"""Bad command-line input, each as a user types it: a real `python -m workbench ...` process that must answer with
exactly one line, `error: ...`, naming the option, with exit code 2 and no traceback, found before any work starts
(no weights made, nothing compiled, no GPU asked for). Also: seeds through the API, the output paths of the scripts,
and a worker process that leaves no semaphore behind for the resource tracker to complain about.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from workbench import cli
from workbench.errors import UsageError
from workbench.run.runtime import Sampling

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
NO_GPU = cli.NO_GPU


def run_cli(*argv, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def assert_one_error(r: subprocess.CompletedProcess, *names: str) -> str:
    """Exit code 2, and stderr exactly one line `error: ...` that names each of `names`; nothing of a GPU, a
    traceback or work done (weights, compiles) before it."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and NO_GPU not in r.stderr, r.stderr
    assert "weights" not in r.stdout and "compiled" not in r.stdout + r.stderr, r.stdout
    for n in names:
        assert n in lines[0], lines[0]
    return lines[0]


def passes_checks(*argv):
    """The arguments get through parsing and every check of their command, in this process: what a run would do
    next is the work itself (on a GPU machine, minutes of it), so it is not started."""
    args = cli._parser().parse_args([str(a) for a in argv])
    if getattr(args, "max_seq", None) == "max" and not getattr(args, "all_presets", False):
        args.max_seq = cli._longest(args.model)
    cli.COMMANDS[args.cmd][1](args)
    return args


def run_bad(*argv, names=()) -> str:
    """A case that must be refused at once: its one error line."""
    t0 = time.perf_counter()
    r = run_cli(*argv)
    line = assert_one_error(r, *names)
    assert time.perf_counter() - t0 < 30                     # a compile or a weights load would take longer
    return line


# -- seeds: integers in [0, 2**64), the kernel's sampler's 64-bit word; never masked into another seed ---------------

SEED_RANGE = "must be an integer from 0 to 2**64 - 1"


@pytest.mark.parametrize("argv, option, bad", [
    (["generate", "--seed", "-1", "--prompt-random", "4"], "--seed", -1),    # numpy's default_rng raised here
    (["generate", "--seed", str(2 ** 64)], "--seed", 2 ** 64),
    (["generate", "--seed", str(2 ** 64 + 5), "--temperature", "0.7"], "--seed", 2 ** 64 + 5),
    (["generate", "--weights-seed", "-1"], "--weights-seed", -1),
    (["generate", "--weights-seed", str(2 ** 64)], "--weights-seed", 2 ** 64),
    (["verify", "--seeds", "1", str(2 ** 64)], "--seeds", 2 ** 64),
    (["verify", "--seeds", "-7"], "--seeds", -7),
])
def test_seeds_out_of_range(argv, option, bad):
    line = run_bad(*argv, names=(f"argument {option}:", SEED_RANGE))
    assert line.endswith(f"got {bad}")


@pytest.mark.parametrize("text", ["abc", "1.5", "nan", "", "0x10", "inf"])
def test_seeds_that_are_not_integers(text):
    run_bad("generate", "--seed", text, "--temperature", "1", names=("argument --seed:", "is not an integer"))


@pytest.mark.parametrize("seed", [0, 2 ** 64 - 1])
def test_seeds_at_the_edges_are_taken(seed):
    args = passes_checks("generate", "--model", "tiny", "--seed", seed, "--temperature", "0.8", "--prompt-random",
                         "3", "--weights-seed", seed)
    assert args.seed == seed and args.weights_seed == seed and len(args.prompt_tokens) == 3
    assert passes_checks("verify", "--model", "tiny", "--seeds", seed, 2 ** 63).seeds == [seed, 2 ** 63]
    Sampling(0.8, 0, 1.0, seed).check(1000)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 2 ** 70, 1.0, "3", True, None])
def test_sampling_refuses_a_seed_it_would_have_masked(seed):
    with pytest.raises(UsageError) as e:
        Sampling(0.8, 0, 1.0, seed).check(1000)
    assert str(e.value).startswith(f"seed {SEED_RANGE} (a 64-bit seed), got ")


@pytest.mark.parametrize("seed", [0, 1, 2 ** 64 - 1, np.uint64(2 ** 64 - 1), np.int32(7)])
def test_sampling_takes_every_64_bit_seed(seed):
    Sampling(0.8, 0, 1.0, seed).check(1000)
    assert Sampling.seed_problem(seed) is None


def test_the_cli_and_the_api_say_the_same_sentence():
    r = run_cli("generate", "--seed", "-1")
    api = Sampling.seed_problem(-1)
    assert r.stderr.strip() == f"error: argument --seed: {api}"


@pytest.mark.parametrize("kw", [{"seed": -1}, {"seed": 2 ** 64}, {"verify_seed": -3}, {"verify_seed": 2 ** 64}])
def test_workbench_refuses_bad_seeds_before_building(kw):
    """The constructor refuses the seed at once: nothing loaded, no backend, no compile."""
    from workbench.loop.session import Workbench
    name = next(iter(kw))
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as e:
        Workbench("tiny", device="cpu", activate=False, build=False, **kw)
    assert str(e.value).startswith(f"{name} {SEED_RANGE}")
    assert time.perf_counter() - t0 < 5


def test_workbench_takes_the_largest_seed():
    from workbench.loop.session import Workbench
    wb = Workbench("tiny", device="cpu", activate=False, build=False, seed=2 ** 64 - 1, verify_seed=0)
    try:
        assert wb.seed == 2 ** 64 - 1
    finally:
        wb.close()


# -- output paths: checked before the run, not written after it ----------------------------------------------------

def unwritable_folder(tmp_path) -> Path:
    """A folder this process cannot create files in. As root, permissions do not stop a write: a folder of the
    kernel's sysfs refuses new files to everyone."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return d
    sysfs = Path("/sys")
    try:
        tempfile.TemporaryFile(dir=sysfs).close()
    except OSError:
        return sysfs
    pytest.skip("no folder here refuses a file to root")


@pytest.mark.parametrize("case", ["missing folder", "a folder", "a file as folder", "unwritable", "empty",
                                  "ends with a separator"])
def test_bench_json_path_is_checked_first(tmp_path, case):
    (tmp_path / "file.txt").write_text("x")
    path = {"missing folder": tmp_path / "no" / "such" / "x.json", "a folder": tmp_path,
            "a file as folder": tmp_path / "file.txt" / "x.json",
            "unwritable": unwritable_folder(tmp_path) / "x.json" if case == "unwritable" else None,
            "empty": "", "ends with a separator": str(tmp_path / "newdir") + os.sep}[case]
    line = run_bad("bench", "--model", "tiny", "--no-torch", "--json", path, names=("argument --json:",))
    assert "cannot write" in line


def test_bench_json_into_a_good_folder_passes_the_check(tmp_path):
    assert passes_checks("bench", "--model", "tiny", "--no-torch", "--json", tmp_path / "x.json").json
    assert list(tmp_path.iterdir()) == []                                    # the probe is gone
    (tmp_path / "old.json").write_text("{}")
    passes_checks("bench", "--model", "tiny", "--no-torch", "--json", tmp_path / "old.json")
    assert (tmp_path / "old.json").read_text() == "{}"                       # an old file is left as it was


@pytest.mark.parametrize("script", ["failure_suite.py", "mutation_suite.py", "ab_prefill_attention.py",
                                    "prefill_profile.py"])
def test_scripts_check_their_json_path(tmp_path, script):
    if script == "ab_prefill_attention.py":
        pytest.importorskip("cupy")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--json", str(tmp_path / "no" / "x.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "argument --json: cannot write" in r.stderr.splitlines()[-1]


@pytest.mark.parametrize("argv", [["compile_time.py", "--model", "tiny"], ["loop_compile_time.py", "--model", "tiny"],
                                  ["ab.py", "--model", "tiny", "--variant", "a:"]])
def test_scripts_check_their_out_folder_before_working(tmp_path, argv):
    """They wrote $OUT/<name>.json after minutes of compiles or runs, and failed there when $OUT could not be."""
    if argv[0] == "ab.py":
        pytest.importorskip("cupy")
    (tmp_path / "file").write_text("x")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={**os.environ, "OUT": str(tmp_path / "file" / "out")})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "$OUT=" in r.stderr.splitlines()[-1] and "is not a folder" in r.stderr.splitlines()[-1]
    assert time.perf_counter() - t0 < 30


def test_device_suite_checks_its_out_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_suite.py"), "--out",
                        str(tmp_path / "file" / "a" / "b"), "--only", "smoke"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "argument --out: cannot write in" in r.stderr.splitlines()[-1], r.stderr
    assert not (tmp_path / "file").is_dir()


def test_output_path_problems_directly(tmp_path):
    assert cli.output_path_problem(str(tmp_path / "x.json")) is None
    assert "does not exist" in cli.output_path_problem(str(tmp_path / "a" / "x.json"))
    assert "is a folder" in cli.output_path_problem(str(tmp_path))
    assert cli.output_folder_problem(str(tmp_path / "a" / "b"), parents=True) is None
    assert "does not exist" in cli.output_folder_problem(str(tmp_path / "a" / "b"), parents=False)
    (tmp_path / "f").write_text("")
    assert "not a folder" in cli.output_folder_problem(str(tmp_path / "f"), parents=True)
    assert list(tmp_path.iterdir()) == [tmp_path / "f"]                  # nothing made, nothing left behind


# -- --arch and the other choices of build: refused at parse time, never handed to a compiler -----------------------

@pytest.mark.parametrize("argv, names", [
    (["build", "--model", "tiny", "--arch", "sm_bogus"], ("argument --arch:", "'sm_bogus'", "sm_90", "gfx942")),
    (["build", "--model", "tiny", "--arch", ""], ("argument --arch:",)),
    (["build", "--model", "tiny", "--arch", "sm_75"], ("argument --arch:", "sm_90")),
    (["build", "--model", "tiny", "--arch", "compute_90"], ("argument --arch:",)),
    (["build", "--model", "tiny", "--target", "cuda", "--arch", "gfx942"], ("--arch gfx942", "--target hip")),
    (["build", "--model", "tiny", "--target", "hip", "--arch", "sm_90"], ("--arch sm_90", "--target cuda")),
    (["build", "--model", "tiny", "--dump", "sass", "--arch", "gfx942"], ("--dump sass", "--target cuda")),
])
def test_build_arch(argv, names):
    run_bad(*argv, names=names)


def test_every_supported_arch_parses():
    from workbench.compiler.compile import CUDA_ARCHS, HIP_ARCHS
    for a in CUDA_ARCHS + HIP_ARCHS:
        args = cli._parser().parse_args(["build", "--model", "tiny", "--arch", a])
        cli._check_build(args)
        assert args.target == ("hip" if a.startswith("gfx") else "cuda")


def test_an_amd_arch_alone_means_target_hip():
    """It goes to clang, never to NVRTC (which refused it, in two lines with exit code 1)."""
    r = run_cli("build", "--model", "tiny", "--arch", "gfx90a", timeout=300)
    assert "Traceback" not in r.stderr and "nvrtc" not in r.stderr + r.stdout
    assert "tiny gfx90a" in r.stdout + r.stderr or "clang" in r.stderr


@pytest.mark.parametrize("argv, names", [
    (["build", "--target", "rocm"], ("argument --target:", "'rocm'")),
    (["build", "--dump", "elf"], ("argument --dump:", "'elf'")),
    (["build", "--model", "tiny", "--dump", "ptx", "--section", ""], ("argument --section:",)),
    (["build", "--model", "tiny", "--variant", "embedding=nope"], ("--variant embedding=nope",)),
    (["build", "--all-presets", "--model", "tiny"], ("--all-presets", "--model")),
    (["build", "--model", "tiny", "--dump", "ptx", "--no-spills"], ("--no-spills", "--dump")),
    (["build", "--model", "tiny", "--variant", "embedding=ptx", "--variant", "embedding=gcn"],
     ("--variant embedding=ptx", "--variant embedding=gcn")),
    (["sanitize", "--tool", "asan"], ("argument --tool:", "'asan'")),
    (["bench", "--set", "threads=128", "--set", "threads=256"], ("--set", "threads")),
])
def test_other_choices(argv, names):
    run_bad(*argv, names=names)


# -- the rest of the class, found by trying every subcommand with wrong values ---------------------------------------

@pytest.mark.parametrize("argv, names", [
    (["generate", "--model", ""], ("argument --model:",)),
    (["plan", "--model", " "], ("argument --model:",)),
    (["generate", "--weights", ""], ("argument --weights:",)),
    (["generate", "--timeout", "1e308"], ("argument --timeout:",)),
    (["generate", "--temperature", "1e-300"], ("argument --temperature:", "1e-300")),
    (["generate", "--timeout", "inf"], ("argument --timeout:",)),
    (["verify", "--draws", "99999999999", "--sampling"], ("argument --draws:",)),
])
def test_numbers_and_names_out_of_range(argv, names):
    run_bad(*argv, names=names)


@pytest.mark.parametrize("argv, names", [
    (["generate", "--model", "tiny", "--top-k", "5"], ("--top-k 5", "--temperature")),
    (["generate", "--model", "tiny", "--top-p", "0.9"], ("--top-p 0.9", "--temperature")),
    (["generate", "--model", "tiny", "--seed", "3"], ("--seed 3", "--temperature")),
    (["generate", "--model", "tiny", "--prefill", "--check-prefill", "--prompt-ids", "5"], ("--prefill",)),
    (["generate", "--model", "tiny", "--check-prefill", "--prompt-ids", "5"], ("--check-prefill", "2 tokens")),
    (["generate", "--model", "tiny", "--check-prefill"], ("--check-prefill", "the default prompt has 1")),
    (["generate", "--model", "tiny", "--no-prefill", "--check-prefill", "--prompt-ids", "5,6"],
     ("--check-prefill", "--no-prefill")),
    (["generate", "--model", "tiny", "--no-prefill", "--prefill-precision", "bf16", "--prompt-ids", "5,6"],
     ("--prefill-precision bf16", "--no-prefill")),
    (["generate", "--model", "tiny", "--prefill-precision", "bf16"], ("--prefill-precision bf16", "1 token")),
    (["verify", "--model", "tiny", "--prefill-precision", "bf16"], ("--prefill-precision bf16", "--prefill-len")),
    (["verify", "--model", "tiny", "--draws", "500"], ("--draws", "--sampling")),
    (["sanitize", "--model", "tiny", "--prompt-ids", "5000", "--sanitizer", sys.executable], ("--prompt-ids",)),
    (["sanitize", "--model", "tiny", "--tokens", "99999", "--sanitizer", sys.executable], ("--tokens 99999",)),
])
def test_options_that_would_be_ignored_or_fail_late(argv, names):
    run_bad(*argv, names=names)


@pytest.mark.parametrize("seed", ["4", "0"])       # 0, the default, is as ignored when said aloud
def test_weights_seed_with_real_weights(tiny_hf_checkpoint, seed):
    run_bad("generate", "--model", tiny_hf_checkpoint, "--weights-seed", seed, names=("--weights-seed", seed))
    run_bad("verify", "--model", "tiny", "--weights", tiny_hf_checkpoint, "--weights-seed", seed,
            names=("--weights-seed",))
    assert passes_checks("generate", "--model", tiny_hf_checkpoint).weights_seed == 0


@pytest.mark.parametrize("argv, prefilled", [
    (["--prompt-ids", "5,6"], True),                  # the default: a prompt of 2 tokens or more is prefilled
    (["--prompt-random", "300"], True),
    (["--prompt-ids", "5,6", "--prefill"], True),
    (["--prompt-ids", "5,6", "--no-prefill"], False),
    (["--prompt-ids", "5"], False),                   # one token: it is the kernel's, nothing to prefill
    ([], False),                                      # the default prompt, the BOS token alone
])
def test_prompts_are_prefilled_by_default(argv, prefilled):
    args = passes_checks("generate", "--model", "tiny", *argv)
    assert args.prefill is prefilled and args.prefill_precision == "fp32"


@pytest.mark.parametrize("argv", [["generate", "--prompt-ids", "5,6"], ["verify", "--prefill-len", "9"]])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_prefills_precision_reaches_the_run(argv, precision):
    assert passes_checks(*argv, "--model", "tiny", "--prefill-precision", precision).prefill_precision == precision


def test_stop_on_eos_with_no_eos_token(tmp_path):
    import json
    cfg = {**cli.get_config("tiny").to_hf_dict(), "eos_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run_bad("generate", "--model", tmp_path, "--stop-on-eos", names=("--stop-on-eos", "eos_token_id"))
    passes_checks("generate", "--model", "tiny", "--stop-on-eos")


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "tiny", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"],
    ["generate", "--model", "tiny", "--seed", "3", "--prompt-random", "5"],     # greedy: the seed makes the prompt
    ["generate", "--model", "tiny", "--prefill", "--check-prefill", "--prompt-ids", "5,6"],
    ["generate", "--model", "tiny", "--timeout", "600"],
    ["verify", "--model", "tiny", "--sampling", "--draws", "500"],
    ["sanitize", "--model", "tiny", "--tokens", "3", "--sanitizer", sys.executable],
    ["build", "--model", "tiny", "--target", "hip", "--arch", "gfx942", "--dump", "amdgcn", "--section", "matvec"],
    ["build", "--all-presets", "--arch", "sm_100", "--no-spills"],
    ["build", "--all-presets", "--max-seq", "max"],          # each preset's own: the 1b's is past smollm2's
])
def test_what_fits_together_passes_the_checks(argv):
    """The checks refuse no more than they should."""
    passes_checks(*argv)


# -- the worker process: no semaphore left for the resource tracker --------------------------------------------------

class LoadingService:
    """What the command line's worker does before its kernel starts, without a GPU: the model's random weights made
    and prepared with their progress bars on (tqdm's, which take a lock meant to be shared between processes)."""

    def __init__(self, buf, header, n_words, words):
        from workbench.run.worker import phase_setter
        self.set_phase = phase_setter(words)

    def load(self, model: str) -> int:
        from workbench.model.config import get_config
        from workbench.model.weights import prepare, random_weights
        cfg = get_config(model)
        cfg = cfg.with_(n_layers=max(cfg.n_layers, 6))          # past the 4 layers under which no bar is shown
        return prepare(random_weights(cfg, xp=np, progress=True), xp=np, progress=True).nbytes()

    def load_then_hang(self, model: str):
        self.load(model)
        self.set_phase("running", 0.2, 4)
        while True:
            time.sleep(0.01)


WORKER_RUN = """
import sys
from test_bad_cli import LoadingService
from workbench.run.worker import Worker, WorkerFailure
w = Worker(LoadingService, hang_s=0.5, grace_s=0.3, max_tokens=64)
try:
    w.start()
    print(w.call(sys.argv[1], "tiny"))
except WorkerFailure as f:
    print(f.kind)
finally:
    w.close()
"""


@pytest.mark.parametrize("method, answer", [("load", None), ("load_then_hang", "hang")])
def test_a_worker_leaves_no_semaphore_behind(method, answer):
    """Every GPU command used to end with `resource_tracker: There appear to be 1 leaked semaphore objects`: the
    worker's progress bars made a named semaphore, and the worker ends with os._exit, which skips what would have
    removed it. Now none is left, whether the worker ends by itself or is killed for a hang."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", WORKER_RUN, method], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()[-1]
    assert out == answer if answer else int(out) > 0
    assert "resource_tracker" not in r.stderr and "leaked" not in r.stderr, r.stderr
