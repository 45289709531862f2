"""Everything the GPU must show, in one call: a smoke run, the GPU tests, the mutation suite, the failure
injections (hangs, faults, compiler hangs through the loop's worker), compute-sanitizer, `verify` on every preset,
the editing loop's timings, the bench (this tree against a base tree in the same run, and PyTorch), and
re-recorded timing traces.

    python scripts/device_suite.py [--out DIR] [--only smoke pytest mutants failures sanitize verify loop assembly numba
                                   ahead prefill bench record schedule hazy]
                                   [--base DIR] [--verify-models M ...] [--set FIELD=VALUE ...]

`schedule` records the register path's traces at 0, 128 and 4,096 and the stream build's at 128 in one run, measures
one SM's read, checks the schedule simulator on them and A/Bs the L1 split (BuildOptions.smem_carveout) against the
stream build. `hazy` builds Hazy Research's megakernel from the sources under --anchors (MK, TK, the pydra-config
wheel and the two anchor scripts) and runs it interleaved with our bench at position 128 and 4,096.

Each part runs in its own process with a time limit (a hang or a crash in one cannot take the others down), its
output goes to DIR/<part>.log, and the summary table comes last. `--base` names another checkout (e.g. the
previous commit's) whose bench runs interleaved with this one's, for A/B of the kernel speed in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
sys.path.insert(0, str(ROOT))

from workbench.compiler.assemble import option_from_text  # noqa: E402
from workbench.cli import output_folder  # noqa: E402
from workbench.model.config import PRESETS  # noqa: E402


T0 = time.perf_counter()
BUDGET = [1e9]                 # seconds for the whole suite (--budget): parts that would pass it are skipped


def run(name: str, cmd: list[str], out: Path, timeout: int, cwd: Path = ROOT, env=None) -> dict:
    left = BUDGET[0] - (time.perf_counter() - T0)
    if left < 30:
        print(f"\n=== {name}: skipped, {left:.0f} s of the budget left", flush=True)
        return {"rc": "skipped", "s": 0, "tail": []}
    timeout = int(min(timeout, left))
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    dt = time.perf_counter() - t0
    tail = log.read_text(errors="replace").strip().splitlines()[-12:]
    print(f"\n=== {name}: rc={rc} in {dt:.0f} s\n" + "\n".join(tail), flush=True)
    return {"rc": rc, "s": round(dt, 1), "tail": tail}


SMOKE = r"""
import cupy as cp, time
from workbench.compiler.assemble import BuildOptions
from workbench.check.verify import verify_stages, verify
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights
from workbench.run.runtime import Monokernel
for name in ("tiny", "llama-3.2-1b"):
    p = prepare(random_weights(get_config(name), 1, xp=cp, progress=False), xp=cp, progress=False)
    mk = Monokernel(p, BuildOptions(), max_steps=64)
    r = mk.generate([1, 2, 3], 8, eos=[])
    print(name, "tokens", r.tokens, f"{r.tok_per_s:.0f} tok/s", mk.resources())
    print(verify(mk, prompt_len=6, max_new=10, seed=2).summary())
    t = Monokernel(p, BuildOptions(taps=True), max_steps=256)
    for i in range(3):                                  # the first pays for CuPy's kernel compiles
        t0 = time.perf_counter()
        table, runs = verify_stages(t, seed=3 + i)
        print(f"verify_stages {time.perf_counter() - t0:.3f} s", {k: round(v, 3) for k, v in table.seconds.items()})
    print(table.text())
"""

LOOP = r"""
import json, os, sys
from workbench.loop.benchmark import loop_benchmark
out = loop_benchmark("llama-3.2-1b", edits=10, fast_compile_levels=("mid",), whole=True)
json.dump(out, open(os.path.join(sys.argv[1], "loop.json"), "w"), indent=1, default=str)
keys = ("section", "compile_s", "timed_compile_s", "verify_s", "time_s", "edit_to_verdict_s", "edit_to_record_s",
        "passed")
for r in out["edit_runs"]:
    print({k: r[k] for k in keys})
    print("   verify:", {k: round(v, 3) for k, v in (r["verify_parts"] or {}).items()})
print("median", out["edit"])
for level, m in out["verify_fast_compile"]["levels"].items():
    print(f"verification build {'whole' if level == 'whole' else 'whole, -Ofc=' + level}:",
          {k: v for k, v in m.items() if k != "runs"})
print("wrong edit:", out["wrong_edit"]["first_failure"], out["wrong_edit"]["caught_as_q_layer0"])
print("overhead", {k: v for k, v in out["overhead"].items() if k.endswith("pct") or k.endswith("tok_s")})
"""

NUMBA = r"""
import json, os, sys
from workbench.loop.benchmark import numba_loop_benchmark
out = numba_loop_benchmark("llama-3.2-1b", edits=6)
json.dump(out, open(os.path.join(sys.argv[1], "numba_loop.json"), "w"), indent=1, default=str)
for k in ("select_variant", "numba_edit", "cpp_edit", "compile_added_s", "verdict_added_s", "undo_restored",
          "files_restored"):
    print(k, out[k])
t, w = out["typing_error"], out["wrong_edit"]
print("typing error:", t["status"], "at the .py line" if t["at_py_line"] else "NOT at the .py line", t["error"])
print("wrong edit (1e-4):", w["first_failure"], "caught as the section at layer 0" if w["caught_as_section_layer0"]
      else "NOT caught as the section at layer 0")
"""

RECORD = r"""
import json, sys, numpy as np, cupy as cp
from pathlib import Path
from workbench.compiler.assemble import with_fields
from workbench.measure import trace as T
from workbench.measure.baselines import stream_read_tbps
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights
from workbench.run.runtime import Monokernel
cfg = get_config("llama-3.2-1b")
p = prepare(random_weights(cfg, 7, xp=cp, progress=False), xp=cp, progress=False)
mk = Monokernel(p, with_fields(timing=True, **json.loads(sys.argv[3])), max_steps=4200)
roof = stream_read_tbps(cfg.weight_bytes_per_token())["tbps"]
for pos in (0, 3700):
    mk.generate([1], 4, eos=[], pos0=pos)
    r = mk.generate([1], 17, eos=[], pos0=pos, timing_steps=17)
    meta = T.recording_meta(cfg, position=pos, tok_s=r.tok_per_s, roofline_tbps=roof, commit=sys.argv[2])
    path = Path(sys.argv[1]) / T.RECORDED[pos]
    T.save_trace(path, r.timing, meta)
    print(path.name)                                  # the table below gives the run's tok/s
    from workbench.measure.timing import format_table
    print(format_table(T.load_trace(path).stage_table(), roof, r.tok_per_s))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=output_folder, default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", nargs="*", default=["smoke", "pytest", "mutants", "failures", "sanitize", "verify",
                                                 "loop", "assembly", "numba", "prefill", "bench", "record"])
    ap.add_argument("--verify-models", nargs="*", default=list(PRESETS), help="default: every preset")
    ap.add_argument("--bench-models", nargs="*", default=["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"])
    ap.add_argument("--sanitize-models", nargs="*", default=["tiny", "llama-3.2-1b"])
    ap.add_argument("--base", help="another checkout to bench against, interleaved (A/B in one run)")
    ap.add_argument("--no-torch", action="store_true", help="bench without the PyTorch rows")
    ap.add_argument("--mutant-levels", nargs="*", default=[], choices=("0", "min", "mid", "max"),
                    help="run the mutation suite again with the verification build at each NVRTC -Ofc level")
    ap.add_argument("--mutant-whole", action="store_true",
                    help="run the mutation suite again with the verification build whole, not in units")
    ap.add_argument("--pytest-args", nargs="*", default=[])
    ap.add_argument("--commit", default="unknown", help="the commit the recorded traces are labelled with")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for the whole suite")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuildOptions or launch field of the kernel the bench and the recorded traces run "
                         "(repeatable)")
    ap.add_argument("--anchors", default=".anchors", help="the folder of Hazy's sources for `hazy`: mk/ (Megakernels), "
                    "tk/ (ThunderKittens), wheels/ (pydra-config), hazy_build.sh and hazy_bench.py")
    ap.add_argument("--wheels", help="a folder of wheels to install first, without an index (a GPU machine without "
                                     "network: cuda-bindings for the verification build in units)")
    a = ap.parse_args()
    BUDGET[0] = a.budget
    sets = [x for item in a.set for x in ("--set", item)]
    out = Path(a.out).resolve()          # the A/B bench runs in the other checkout: a relative path would land there
    out.mkdir(parents=True, exist_ok=True)
    R = {}
    if a.wheels:
        wheels = sorted(str(w) for w in Path(a.wheels).glob("*.whl"))
        R["wheels"] = run("wheels", [PY, "-m", "pip", "install", "--no-index", "--no-deps", *wheels], out, 120)
    if "smoke" in a.only:
        R["smoke"] = run("smoke", [PY, "-c", SMOKE], out, 240)
    if "mutants" in a.only:
        R["mutants"] = run("mutants", [PY, "scripts/mutation_suite.py", "--model", "llama-3.2-1b", "--json",
                                       str(out / "mutants.json")], out, 480)
        for level in a.mutant_levels:
            R[f"mutants-Ofc-{level}"] = run(f"mutants-Ofc-{level}", [
                PY, "scripts/mutation_suite.py", "--model", "llama-3.2-1b", "--verify-fast-compile", level,
                "--json", str(out / f"mutants_Ofc_{level}.json")], out, 480)
        if a.mutant_whole:
            R["mutants-whole"] = run("mutants-whole", [
                PY, "scripts/mutation_suite.py", "--model", "llama-3.2-1b", "--verify-whole",
                "--json", str(out / "mutants_whole.json")], out, 480)
    if "failures" in a.only:
        R["failures"] = run("failures", [PY, "scripts/failure_suite.py", "--model", "llama-3.2-1b", "--json",
                                         str(out / "failures.json")], out, 360)
    if "sanitize" in a.only:
        for m in a.sanitize_models:
            R[f"sanitize-{m}"] = run(f"sanitize-{m}", [PY, "-m", "workbench", "sanitize", "--model", m, "--tokens",
                                                      "2"], out, 540)
    if "verify" in a.only:
        for m in a.verify_models:
            R[f"verify-{m}"] = run(f"verify-{m}", [PY, "-m", "workbench", "verify", "--model", m, "--prompt-len",
                                                  "4090" if m == "tiny" else "8", "--tokens", "8"], out, 300)
        R["verify-sampling"] = run("verify-sampling", [PY, "-m", "workbench", "verify", "--model", "llama-3.2-1b",
                                                       "--sampling", "--draws", "10000"], out, 300)
    if "pytest" in a.only:
        # the files with gpu tests only: the others import the notebook stack, which the device does not have
        R["pytest"] = run("pytest", [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
                                     *a.pytest_args, "tests/test_gpu.py", "tests/test_gpu_session.py",
                                     "tests/test_reference.py"], out, 540)
    if "loop" in a.only:
        R["loop"] = run("loop", [PY, "-c", LOOP, str(out)], out, 300)
    if "assembly" in a.only:
        # the shipped PTX section against its C++ version, verified and timed in one run, per stage
        R["assembly"] = run("assembly", [PY, "scripts/ab.py", "--model", "llama-3.2-1b", "--variant", "cpp:",
                                         "--variant", "ptx:@embedding=ptx", "--variant",
                                         "gemv_ptx:@o_proj_residual=ptx", "--stages"], out, 300)
    if "numba" in a.only:
        # the numba variant against its C++ original, verified and timed in one run, per stage; then the loop on
        # a numba edit (edit → verdict against a C++ edit's, a typing error at its .py line, a 1e-4 edit named)
        R["numba-ab"] = run("numba-ab", [PY, "scripts/ab.py", "--model", "llama-3.2-1b", "--variant", "cpp:",
                                         "--variant", "numba:@gate_up_silu=numba", "--stages"], out, 300)
        R["numba-loop"] = run("numba-loop", [PY, "-c", NUMBA, str(out)], out, 300)
    if "ahead" in a.only:
        # Launch.ahead and Launch.early_loads (issue 37): the MLP's first units copied during attention and o_proj,
        # and two chunks loaded early, verified stage by stage and bit for bit against the register path, then A/B'd
        # per stage (NOTES.md rounds 29 and 30: predictions, and the H100's measurements)
        R["ahead-verify"] = run("ahead-verify", [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-s",
                                                 "tests/test_gpu.py", "-k", "loaded_ahead or copy_ahead"], out, 300)
        # without early loads at all beside them: the boundary tables show each split barrier's release against
        # the bytes in flight at it
        R["ahead-ab"] = run("ahead-ab", [PY, "scripts/ab.py", "--model", "llama-3.2-1b", "--positions", "128", "4096",
                                         "--repeats", "3", "--stages", "--stage-positions", "128", "--variant", "base:",
                                         "--variant", "ahead-120k:opt.ahead=gate_up_silu", "--variant",
                                         "ahead-64k:opt.ahead=gate_up_silu,opt.ahead_bytes=65536", "--variant",
                                         "early16:opt.early_loads=16", "--variant",
                                         "early16-ahead:opt.early_loads=16,opt.ahead=gate_up_silu", "--variant",
                                         "no-early:opt.early=", "--variant", "base-again:"], out, 420)
    if "prefill" in a.only:
        # the prefill's own kernels against the reference first, then time to first token against HF's prefill
        # (with the prefill's time per stage), then a long prefill verified and decoded after
        R["prefill-kernels"] = run("prefill-kernels", [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                                       "-s", "tests/test_gpu.py", "-k",
                                                       "prefills_attention or prefills_gpu_path or fused_causal_softmax "
                                                       "or bf16"], out, 240)
        for m in ("llama-3.2-1b", "llama-3.1-8b"):
            R[f"ttft-{m}"] = run(f"ttft-{m}", [PY, "-m", "workbench", "bench", "--model", m, "--positions", "128",
                                               "--tokens", "32", "--repeats", "3", "--no-hf", "--no-compile",
                                               "--ttft", "--first-token", "prefill", "kernel",
                                               "--json", str(out / f"ttft_{m}.json")], out, 420)
        R["verify-prefill"] = run("verify-prefill", [PY, "-m", "workbench", "verify", "--model", "llama-3.2-1b",
                                                     "--max-seq", "40000", "--prefill-len", "32000"], out, 420)
    if "bench" in a.only:
        for m in a.bench_models:
            order = [("new", ROOT)] + ([("base", Path(a.base).resolve())] if a.base else [])
            for i in range(2 if a.base else 1):
                for tag, tree in order:
                    R[f"bench-{m}-{tag}-{i}"] = run(
                        f"bench-{m}-{tag}-{i}", [PY, "-m", "workbench", "bench", "--model", m, "--no-torch",
                                                  "--json", str(out / f"bench_{m}_{tag}_{i}.json"),
                                                  *(sets if tag == "new" else [])], out, 300,
                        cwd=tree, env={"PYTHONPATH": str(tree)})
            if not a.no_torch:
                R[f"bench-{m}-torch"] = run(f"bench-{m}-torch", [PY, "-m", "workbench", "bench", "--model", m,
                                                                "--no-hf", "--json", str(out / f"bench_{m}.json"),
                                                                *sets], out, 420)
    if "record" in a.only:
        options = {k: option_from_text(k, v) for k, _, v in (x.partition("=") for x in a.set)}
        R["record"] = run("record", [PY, "-c", RECORD, str(out), a.commit, json.dumps(options)], out, 240)
    if "schedule" in a.only:
        plain, stream = out / "traces_plain", out / "traces_stream"
        R["traces-plain"] = run("traces-plain", [PY, "scripts/record_traces.py", str(plain), "--positions", "0", "128",
                                                 "4096"], out, 300)
        R["traces-stream"] = run("traces-stream", [PY, "scripts/record_traces.py", str(stream), "--set", "stream=1",
                                                   "--positions", "128"], out, 200)
        R["sm-bandwidth"] = run("sm-bandwidth", [PY, "scripts/sm_bandwidth.py"], out, 120)
        fit = sorted(str(f) for f in plain.glob("*_pos0.npz")) + sorted(str(f) for f in plain.glob("*_pos4096.npz"))
        check = sorted(str(f) for f in plain.glob("*_pos128.npz")) + sorted(str(f) for f in stream.glob("*.npz"))
        R["simulate-check"] = run("simulate-check", [PY, "-m", "workbench", "simulate", *fit, "--check", *check],
                                  out, 180)
        R["ab-carveout"] = run("ab-carveout", [PY, "scripts/ab.py", "--model", "llama-3.2-1b", "--positions", "128",
                                               "--repeats", "2", "--variant", "base:", "--variant",
                                               "l1-small:opt.smem_carveout=100", "--variant", "stream:opt.stream=1"],
                               out, 300)
    if "hazy" in a.only:
        anchors = Path(a.anchors).resolve()
        site = out / "hazy_site"
        R["hazy-deps"] = run("hazy-deps", [PY, "-m", "pip", "install", "--no-index", "--no-deps", "--target",
                                           str(site), *map(str, sorted((anchors / "wheels").glob("*.whl")))], out, 120)
        R["hazy-build"] = run("hazy-build", ["bash", str(anchors / "hazy_build.sh"), str(anchors / "mk"),
                                             str(anchors / "tk")], out, 300)
        env = {"PYTHONPATH": f"{site}:{anchors / 'mk'}", "OUT": str(out)}
        for i in range(2):                                       # interleaved: the two share the card's state
            R[f"hazy-{i}"] = run(f"hazy-{i}", [PY, str(anchors / "hazy_bench.py"), str(anchors / "mk")], out, 240,
                                 env=env)
            R[f"bench-hazy-{i}"] = run(f"bench-hazy-{i}", [PY, "-m", "workbench", "bench", "--model", "llama-3.2-1b",
                                                           "--positions", "128", "4096", "--no-torch", "--no-hf",
                                                           "--json", str(out / f"bench_vs_hazy_{i}.json")], out, 240)
    (out / "suite.json").write_text(json.dumps(R, indent=1, default=str))
    print("\n=== summary")
    for k, v in R.items():
        print(f"{k:28s} {'ok ' if v['rc'] == 0 else 'FAIL'} rc={v['rc']} {v['s']:6.0f} s  {v['tail'][-1][:110] if v['tail'] else ''}")


if __name__ == "__main__":
    main()
