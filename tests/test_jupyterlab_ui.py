"""The quickstart notebook in a real JupyterLab, driven like a person would: headless Chromium (Debian's, through
Playwright; Playwright never downloads a browser here) opens notebooks/quickstart.ipynb, runs all cells from the
Run menu, and the plotly dashboard must render.

The server runs on a free local port with a token, as root if need be, with HOME and every Jupyter folder in a
temporary directory, and serves a copy of the notebook there (JupyterLab saves what it runs, outputs included; the
notebook in git stays without outputs); the kernel imports workbench from this checkout through PYTHONPATH. The
server is always shut down (REST shutdown, then terminate, then kill).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_S = 90          # JupyterLab answering /api/status
RUN_ALL_S = 180              # kernel start + every cell of the quickstart + the dashboard rendered


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def lab(tmp_path):
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install -e '.[notebooks]')")
    port, token = _free_port(), uuid.uuid4().hex
    dirs = {k: tmp_path / k for k in ("home", "config", "data", "runtime", "ipython", "settings", "workspaces",
                                      "lab")}
    for d in dirs.values():
        d.mkdir()
    # JupyterLab's "notified about official Jupyter news?" toast (which --LabApp.news_url=None does not stop) sits
    # over the bottom right of the page, the dashboards' legends, until answered: answered "never", as a user would
    notification = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    # the server serves a copy: JupyterLab saves the notebook it runs (outputs and all), and the one in git stays clean
    (dirs["lab"] / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", dirs["lab"] / "notebooks" / "quickstart.ipynb")
    env = dict(os.environ, HOME=str(dirs["home"]), JUPYTER_CONFIG_DIR=str(dirs["config"]),
               JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               IPYTHONDIR=str(dirs["ipython"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    log = open(tmp_path / "jupyterlab.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           "--port-retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={dirs['lab']}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, cwd=dirs["lab"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{(tmp_path / 'jupyterlab.log').read_text()}")
            try:
                if _get(f"{base}/api/status?token={token}") == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer in {SERVER_START_S} s:\n"
                            f"{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"base": base, "token": token, "log": tmp_path / "jupyterlab.log", "tmp": tmp_path}
    finally:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10).close()
        except OSError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)       # the process group this test started
                proc.wait(timeout=10)
        log.close()


def _wait_kernel_idle(lab, path: str, timeout_s: float):
    """Until the server has a session for `path` whose kernel is idle (started and ready)."""
    import json
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{lab['base']}/api/sessions?token={lab['token']}", timeout=5) as r:
                sessions = json.loads(r.read())
            if any(s.get("path") == path and s.get("kernel", {}).get("execution_state") == "idle" for s in sessions):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"no idle kernel for {path} after {timeout_s} s:\n{lab['log'].read_text()[-3000:]}")
        time.sleep(0.5)


def test_quickstart_dashboard_renders_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    original = (ROOT / "notebooks" / "quickstart.ipynb").read_bytes()
    url = f"{lab['base']}/lab/tree/notebooks/quickstart.ipynb?token={lab['token']}"
    shot = lab["tmp"] / "quickstart.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(url, wait_until="domcontentloaded", timeout=120_000)
            # the notebook is open and its kernel is up
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            _wait_kernel_idle(lab, "notebooks/quickstart.ipynb", 120)
            # Run → Run All Cells, from the menu bar
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            try:
                page.wait_for_selector(".jp-OutputArea-output .js-plotly-plot", state="attached",
                                       timeout=RUN_ALL_S * 1000)
                page.wait_for_selector(".wb-dashboard-header", timeout=30_000)
            finally:
                page.screenshot(path=str(shot), full_page=True)
                if os.environ.get("WB_UI_SCREENSHOT"):
                    shutil.copy(shot, os.environ["WB_UI_SCREENSHOT"])
            header = page.locator(".wb-dashboard-header").first.inner_text()
            assert "recorded on NVIDIA H200" in header or "live on" in header
            plots = page.locator(".jp-OutputArea-output .js-plotly-plot")
            assert plots.count() >= 4                      # stages, bandwidth, Gantt, tok/s
            assert page.locator(".jp-OutputArea-output .js-plotly-plot .main-svg").count() >= 4
            if os.environ.get("WB_UI_SCREENSHOT"):                # also each plot, to look at
                stem = Path(os.environ["WB_UI_SCREENSHOT"])
                for i in range(plots.count()):
                    if not plots.nth(i).is_visible():
                        continue                           # the A/B panel stays hidden until compare()
                    plots.nth(i).scroll_into_view_if_needed()
                    plots.nth(i).screenshot(path=str(stem.with_name(f"{stem.stem}-plot{i}.png")))
            outputs = " ".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "Traceback" not in outputs, outputs[-3000:]
        finally:
            browser.close()
    assert (ROOT / "notebooks" / "quickstart.ipynb").read_bytes() == original, "the notebook in git was changed"
