"""plotly's FigureWidget with one copy of plotly.js a page, and names for a heatmap's cells made in the browser.

plotly's widget module (plotly.js and its widget, ~5 MB) is the `_esm` of every FigureWidget, and anywidget imports
each model's `_esm` from a blob URL of its own: no module cache is shared, so every figure parses and runs the 5 MB
again. On a page reload JupyterLab restores every model at once, and anywidget gives each model 2 s from its
creation to load its module (`AbortSignal.timeout(2000)` in its Runtime); a model that misses it keeps a rejected
`ready` promise and drops every later message from the kernel ("[anywidget] Failed to initialize model."), so that
chart never changes again. Measured in headless Chromium on a loaded 2-core machine: one import 1.0–2.0 s alone,
five at once 2.1–18 s each. Here the module each model imports is a small loader, and plotly's module travels as a
plain trait that the first model to load imports for the page; the others wait on the same import.

Hover values per heatmap cell: a heatmap whose `meta` has {"cell_names": [...], "cell_interval": {"name", "start",
"length": typed arrays, one entry per interval shown}, "cell_index": typed array [rows, cols] into cell_interval}
has, for the cell's interval i = cell_index[row, col], cell_names[name[i]], start[i] and length[i] as its hover's
%{_cellname}, %{_cellstart} and %{_celllength}, made here in the browser on the first hover. Sending the names
themselves would cost ~60 ms of Python per slider step (one string a cell, ~120k, walked by plotly's validators,
ipywidgets and json) and far more in the browser (see fillHover); a start and a length a cell are 1.3 MB of base64
a step, where the table of the intervals shown is a few tens of kB.
"""
from __future__ import annotations

import functools
import hashlib

# Runs in the browser.
LOADER = """
const KEY = Symbol.for("workbench.plotly-widget/%(hash)s");

function plotlyModule(model) {
  let p = globalThis[KEY];
  if (!p) {
    const url = URL.createObjectURL(new Blob([model.get("_plotly_module")], {type: "text/javascript"}));
    p = globalThis[KEY] = import(url).finally(() => URL.revokeObjectURL(url));
    p.catch(() => { if (globalThis[KEY] === p) delete globalThis[KEY]; });
  }
  return p;
}

const TYPES = {f4: Float32Array, f8: Float64Array, u1: Uint8Array, u2: Uint16Array, i4: Int32Array, u4: Uint32Array};

function decode(spec) {
  const s = atob(spec.bdata), bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return new TYPES[spec.dtype](bytes.buffer);
}

// [rows][cols] of a per-interval array at each cell's interval (rows as arrays of the values, or typed subarrays)
function perCell(meta) {
  const idx = decode(meta.cell_index), iv = meta.cell_interval;
  const [rows, cols] = String(meta.cell_index.shape).split(",").map(Number);
  const name = decode(iv.name), start = decode(iv.start), length = decode(iv.length);
  const grid = (f, typed) => {
    const out = new Array(rows);
    for (let r = 0; r < rows; r++) {
      const row = typed ? new Float32Array(cols) : new Array(cols);
      for (let c = 0; c < cols; c++) row[c] = f(idx[r * cols + c]);
      out[r] = row;
    }
    return out;
  };
  return {
    _cellname: grid(i => meta.cell_names[name[i]], false),
    _cellstart: grid(i => start[i], true),
    _celllength: grid(i => length[i], true),
  };
}

const HOVER_ATTRS = ["_cellname", "_cellstart", "_celllength"];

// The values go into the full trace as attributes of their own (listed in _arrayAttrs, which plotly.js reads per
// point into the hover's variables: %%{_cellname}), and nowhere else: after every update the widget deep-copies the
// figure's data and full data (lodash merge) but skips keys that start with "_"; ~120k strings in `text` or
// `hovertext` made a slider step 1.9 s, where a typed array is passed by reference.
function fillHover(gd) {
  const cache = gd.__wbCells || (gd.__wbCells = new Map());
  for (const fd of gd._fullData || []) {
    const meta = fd && fd.meta;
    if (!meta || !meta.cell_index || !meta.cell_index.bdata || !meta.cell_interval) continue;
    // made on the first hover, not on every slider step
    const values = () => {
      let got = cache.get(fd.index);
      // a new step may keep the cells' indices and change the intervals: every table is the key
      const iv = meta.cell_interval, key = [meta.cell_index, iv.name, iv.start, iv.length].map(t => t.bdata);
      if (!got || got.key.some((k, i) => k !== key[i])) {
        got = {key, values: perCell(meta)};
        cache.set(fd.index, got);
      }
      return got.values;
    };
    for (const attr of HOVER_ATTRS) {
      Object.defineProperty(fd, attr, {configurable: true, enumerable: false, get() { return values()[attr]; }});
      if (fd._arrayAttrs && !fd._arrayAttrs.includes(attr)) fd._arrayAttrs.push(attr);
    }
  }
}

// every update makes the full traces anew
function attach(gd) {
  if (gd.__wbHover) return;
  gd.__wbHover = true;
  gd.on("plotly_afterplot", () => fillHover(gd));
  fillHover(gd);
}

export { attach };    // for a page without the widget (tests, exports) that wants the names too

export default () => {
  let widget;
  return {
    async initialize(ctx) {
      widget = (await plotlyModule(ctx.model)).default();
      return widget.initialize(ctx);
    },
    render(ctx) {
      const onRender = e => { const gd = e.detail && e.detail.element; if (gd && ctx.el.contains(gd)) attach(gd); };
      document.addEventListener("plotlywidget-after-render", onRender);
      const done = widget.render(ctx);
      return () => { document.removeEventListener("plotlywidget-after-render", onRender); if (done) done(); };
    },
  };
};
"""


@functools.lru_cache(maxsize=None)
def _module_text() -> str:
    import plotly.graph_objects as go
    return str(go.FigureWidget._esm)


@functools.lru_cache(maxsize=None)
def figure_widget_class():
    """The FigureWidget subclass (made on first use: plotly is imported only by the dashboards)."""
    import plotly.graph_objects as go
    import traitlets

    text = _module_text()
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]      # a page that outlives a plotly upgrade loads anew

    class FigureWidget(go.FigureWidget):
        _esm = LOADER % {"hash": digest}
        _plotly_module = traitlets.Unicode(text).tag(sync=True)

    FigureWidget.__module__ = __name__
    FigureWidget.__qualname__ = "FigureWidget"
    return FigureWidget


def figure_widget(*args, **kw):
    """A FigureWidget (see the module docstring for what differs from plotly's)."""
    return figure_widget_class()(*args, **kw)
