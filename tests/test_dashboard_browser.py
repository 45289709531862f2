"""The dashboard of the recorded H200 trace in a real JupyterLab, in headless Chromium (the `lab` fixture of
test_jupyterlab_ui: its own server, Debian's Chromium, no browser download): how long a step of the token slider
takes to redraw the Gantt chart, that every colour it draws is in its legend, that no modebar covers a title and
the A/B legend no stage name, and what the page shows after a reload of the saved notebook.

The slider is moved with the keyboard as a person would (focus its handle, an arrow key); the time is taken in the
page, from the key press to the first frame after the Gantt chart's title names the new token (plotly.js redraws
the heatmap and the title in the same update). The mouse over a block row shows the cell's stage. After the
reload, every model must have loaded (anywidget allows each 2 s; see workbench/ui/figure_widget.py), plotly's 5 MB
module must have been imported once for the page, not once a figure, and the slider must still redraw the chart.
Set WB_UI_SCREENSHOT=/some/dir/name.png to keep screenshots (the page before and after the reload, the Gantt and
A/B charts).
"""
from __future__ import annotations

import os
import re
import shutil
import statistics
from pathlib import Path

import pytest

from test_jupyterlab_ui import CHROMIUM, CHROMIUM_ARGS, _wait_kernel_idle, lab  # noqa: F401  (lab: the fixture)

NOTEBOOK = "dashboard.ipynb"
CELL = """\
from workbench.measure.trace import recorded_path
from workbench.ui.dashboard import Dashboard
dash = Dashboard.from_trace(recorded_path(0))
dash.compare(recorded_path(0), recorded_path(3700))
dash.show()"""
STEPS = 8                    # slider steps timed
TARGET_MS = 200              # the target for one step: printed against the measurement, not asserted (timings are
                             # the machine's: a 2-core CI machine measured 292 ms where another measured 150)
REGRESSION_MS = 1000         # asserted: the redraw this replaced took 1.5-1.8 s a step
RUN_S = 180

# the Gantt chart is the plot whose title names a token
GANTT = "Array.from(document.querySelectorAll('.js-plotly-plot')).find(p => /^Token \\d+/.test(" \
        "(p.querySelector('.gtitle') || {}).textContent || ''))"
GANTT_TITLE = f"(() => {{ const g = {GANTT}; return g ? g.querySelector('.gtitle').textContent : null; }})()"
# pairs of boxes that overlap in any plot: its modebar and its title, its legend and its x tick labels
OVERLAPS = """(() => {
    const box = e => e.getBoundingClientRect();
    const hit = (a, b) => a.width > 0 && b.width > 0 && a.left < b.right && b.left < a.right && a.top < b.bottom
        && b.top < a.bottom;
    const out = [];
    for (const p of document.querySelectorAll('.js-plotly-plot')) {
        if (!p.offsetParent) continue;                                   // a hidden panel
        const title = (p.querySelector('.gtitle') || {}).textContent || '';
        const bar = p.querySelector('.modebar'), t = p.querySelector('.gtitle'), leg = p.querySelector('.legend');
        if (bar && t && hit(box(bar), box(t))) out.push(['modebar', title]);
        if (leg) for (const x of p.querySelectorAll('.xtick text'))
            if (hit(box(leg), box(x))) out.push(['legend', title, x.textContent]);
    }
    return out;
})()"""
# the colours of the Gantt chart's picture (its pixels, decoded by the browser) and of its legend entries
COLOURS = """(async () => {
    const g = %s;
    const hex = c => c.startsWith('#') ? c.toLowerCase() : '#' + c.match(/\\d+/g).slice(0, 3)
        .map(v => (+v).toString(16).padStart(2, '0')).join('');
    const el = Array.from(g.querySelectorAll("image")).find(e => (e.getAttribute("href") || "").length > 0 && e.closest(".layer-above"));
    const img = new Image();
    img.src = el.getAttribute('href') || el.getAttribute('xlink:href');
    await img.decode();
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const ctx = c.getContext('2d');
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, c.width, c.height).data;
    const codes = new Set();
    for (let i = 0; i < px.length; i += 4) if (px[i + 3] === 255) codes.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
    const legend = {};
    for (const e of g.querySelectorAll('.legend .traces')) {
        const p = e.querySelector('.legendpoints path');
        legend[e.querySelector('.legendtext').textContent] = p ? hex(p.style.fill) : null;
    }
    const box = el.getBoundingClientRect(), plot = g.querySelector('.nsewdrag').getBoundingClientRect();
    return {drawn: Array.from(codes).map(v => '#' + v.toString(16).padStart(6, '0')), legend,
            size: [img.naturalWidth, img.naturalHeight], box: [box.width, box.height], plot: [plot.width, plot.height]};
})()""" % GANTT
# arm a timer: the key press starts it, the first frame after the title names `token` stops it
ARM = """token => new Promise(resolve => {
    window.__wb_t0 = null;
    window.__wb_ms = null;
    document.addEventListener('keydown', () => { window.__wb_t0 = performance.now(); }, {capture: true, once: true});
    const check = () => {
        const g = %s;
        const t = g && g.querySelector('.gtitle');
        if (window.__wb_t0 !== null && t && t.textContent.startsWith('Token ' + token + ' ')) {
            requestAnimationFrame(() => { window.__wb_ms = performance.now() - window.__wb_t0; });
            return;
        }
        requestAnimationFrame(check);
    };
    requestAnimationFrame(check);
    resolve();
})""" % GANTT


def _write_notebook(path: Path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _open(page, lab, url):
    page.goto(url, wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)


ANYWIDGET_TIMEOUT = "[anywidget] Failed to initialize model"
# counts the imports of a module of over 1 MB from a blob URL (plotly's is ~5 MB; the widget's loader is small)
COUNT_IMPORTS = """(() => {
    window.__wb_big_blobs = 0;
    const make = URL.createObjectURL.bind(URL);
    URL.createObjectURL = b => { if (b && b.size > 1e6 && b.type === 'text/javascript') window.__wb_big_blobs++;
                                 return make(b); };
})()"""
# the text of the Gantt chart's hover label, after the mouse moved over it
HOVER = f"(() => {{ const g = {GANTT}; return Array.from(g.querySelectorAll('.hovertext'))" \
        ".map(e => e.textContent).join(' | '); })()"


def _wait_gantt_or_failure(page, errors, timeout_s: float = RUN_S):
    """Until the Gantt chart is drawn; a widget model that failed to initialise fails the test at once."""
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate(f"{GANTT} !== undefined"):
            return
        if any(ANYWIDGET_TIMEOUT in e for e in errors):
            pytest.fail(f"after the reload: {errors}")
        page.wait_for_timeout(500)
    pytest.fail(f"no Gantt chart {timeout_s} s after the reload; console errors: {errors}")


def _gantt_token(page) -> int | None:
    text = page.evaluate(GANTT_TITLE)
    return int(text.split()[1]) if text else None


def test_dashboard_slider_reload_and_legend_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    _write_notebook(Path(lab["tmp"]) / "lab" / NOTEBOOK)
    url = f"{lab['base']}/lab/tree/{NOTEBOOK}?token={lab['token']}"
    shot = Path(os.environ["WB_UI_SCREENSHOT"]) if os.environ.get("WB_UI_SCREENSHOT") else None
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.set_default_timeout(60_000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.add_init_script(COUNT_IMPORTS)
            _open(page, lab, url)
            _wait_kernel_idle(lab, NOTEBOOK, 120)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            page.wait_for_function(f"{GANTT} !== undefined", timeout=RUN_S * 1000)
            last = _gantt_token(page)
            assert last is not None and last > STEPS, last          # the slider follows the run: its last token
            if shot:
                page.screenshot(path=str(shot.with_name(f"{shot.stem}-before.png")), full_page=True)

            # -- the slider: one step at a time, timed from the key press to the redrawn chart
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.scroll_into_view_if_needed()
            times = []
            for k in range(1, STEPS + 1):
                token = last - k
                page.evaluate(ARM, token)
                handle.focus()
                page.keyboard.press("ArrowLeft")
                page.wait_for_function("window.__wb_ms !== null", timeout=30_000)
                times.append(page.evaluate("window.__wb_ms"))
                page.wait_for_timeout(150)
            med = statistics.median(times)
            print(f"slider step → Gantt redrawn: median {med:.0f} ms (target {TARGET_MS} ms), "
                  f"all {[round(t) for t in times]} ms")
            shown = last - STEPS
            assert _gantt_token(page) == shown

            # -- every colour the Gantt chart draws has a legend entry (the wait's grey too)
            seen = page.evaluate(COLOURS)
            assert seen["drawn"] and set(seen["drawn"]) <= set(seen["legend"].values()), seen
            assert seen["legend"].get("wait at the barrier") == "#c8c8c8", seen
            # the picture is drawn 1:1 on the plot area: a pixel a time bin, no resampling
            assert seen["size"] == seen["box"] == seen["plot"], seen
            if shot:
                page.evaluate_handle(GANTT).as_element().screenshot(path=str(shot.with_name(f"{shot.stem}-gantt.png")))
                ab = page.evaluate_handle("Array.from(document.querySelectorAll('.js-plotly-plot')).find(p => "
                                          "((p.querySelector('.gtitle') || {}).textContent || '').startsWith('A/B'))")
                ab.as_element().screenshot(path=str(shot.with_name(f"{shot.stem}-ab.png")))

            # -- nothing covers a title or a stage name: the modebar, the A/B legend
            assert page.evaluate(OVERLAPS) == []

            # -- the mouse over a block row: the hover names the block, the cell's stage and layer, and its time
            drag = page.evaluate_handle(f"{GANTT}.querySelector('.nsewdrag')").as_element()
            drag.scroll_into_view_if_needed()
            area = drag.bounding_box()
            page.mouse.move(area["x"] + area["width"] * 0.4 - 5, area["y"] + area["height"] * 0.5)
            page.mouse.move(area["x"] + area["width"] * 0.4, area["y"] + area["height"] * 0.5)
            page.wait_for_function(f"{HOVER}.length > 0", timeout=10_000)
            hover = page.evaluate(HOVER)
            print(f"hover over a block row: {hover!r}")
            assert re.search(r"block \d+: (wait at )?\S+ layer \d+ ?[\d.]+ µs, from [\d.]+ µs", hover), hover
            page.mouse.move(0, 0)

            assert med <= REGRESSION_MS, times

            # -- a reload (of the saved notebook: its outputs name the widgets, which live on in the kernel): the
            # chart shows the slider's token again, and nothing fails to initialise
            page.keyboard.press("Control+s")
            page.wait_for_function("!document.querySelector('.jp-mod-dirty')", timeout=30_000)
            errors.clear()
            page.reload(wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            _wait_gantt_or_failure(page, errors)
            page.wait_for_timeout(2000)                                 # late model set-ups log late
            if shot:
                page.screenshot(path=str(shot.with_name(f"{shot.stem}-reloaded.png")), full_page=True)
            readout = page.locator(".widget-slider .widget-readout").first.inner_text()
            assert int(readout) == shown, readout
            assert _gantt_token(page) == shown
            # plotly's module once for the page: five imports at once took 2-18 s each here, past anywidget's 2 s
            assert page.evaluate("window.__wb_big_blobs") == 1
            # the models take the kernel's messages: a model that missed anywidget's 2 s drops them all
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.scroll_into_view_if_needed()
            handle.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(f"{GANTT_TITLE} && {GANTT_TITLE}.startsWith('Token {shown - 1} ')", timeout=30_000)
            assert not [e for e in errors if "anywidget" in e or "Failed" in e], errors
        finally:
            if shot:
                shutil.copy(lab["log"], shot.with_name(f"{shot.stem}-jupyterlab.log"))
            browser.close()
