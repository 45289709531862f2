"""plotly's FigureWidget with one copy of plotly.js a page, and names for a heatmap's cells made in the browser.

plotly's widget module (plotly.js and its widget, ~5 MB) is the `_esm` of every FigureWidget, and anywidget imports
each model's `_esm` from a blob URL of its own: no module cache is shared, so every figure parses and runs the 5 MB
again. On a page reload JupyterLab restores every model at once, and anywidget gives each model 2 s from its
creation to load its module (`AbortSignal.timeout(2000)` in its Runtime); a model that misses it keeps a rejected
`ready` promise and drops every later message from the kernel ("[anywidget] Failed to initialize model."), so that
chart never changes again. Measured in headless Chromium on a loaded 2-core machine: one import 1.0–2.0 s alone,
five at once 2.1–18 s each. Here the module each model imports is a small loader, and plotly's module travels as a
plain trait that the first model to load imports for the page; the others wait on the same import. The 2 s also
cover the widget's `initialize`, so the loader's returns at once and plotly's own initialize runs when the import
is in (a reload in the full test suite still missed the 2 s twice in three runs while it was awaited there).

Hover text per heatmap cell: a heatmap whose meta is {"hover": "cells"} has, as its hover's %{_cellhover}, the
text of its cell made here from the widget's `_hover_cells` trait (or, on a page without the widget, the table
given to attach): {"rows": a label per row, "ends": whether a row's text gives the interval's end, "names": [...],
"index": typed array [rows, cols] into the intervals shown, "name", "start", "length": typed arrays, one entry per
interval (its name's index, its start and length in µs)}. The texts of a token are made on its first hover. The
dashboard's Gantt chart draws its token as a picture and keeps this heatmap transparent and unchanged from step to
step: a trace's data changed on a step is a full replot in plotly.js. Sending the texts themselves would cost ~60 ms
of Python per slider step (one string a cell, ~120k, walked by plotly's validators, ipywidgets and json) and far
more in the browser (see fillHover).
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

// [rows][cols] of hover texts, a row made when first read (a token's first hover reads one or two rows)
function hoverTexts(cells) {
  const idx = decode(cells.index), name = decode(cells.name), start = decode(cells.start);
  const length = decode(cells.length);
  const [rows, cols] = String(cells.index.shape).split(",").map(Number);
  const made = new Array(rows);
  const row = r => {
    const out = new Array(cols), label = cells.rows[r], end = cells.ends[r];
    for (let c = 0; c < cols; c++) {
      const i = idx[r * cols + c], n = cells.names[name[i]];
      out[c] = !n ? `${label}: nothing recorded`
        : `${label}: ${n}<br>${length[i].toFixed(2)} µs, from ${start[i].toFixed(2)} µs`
          + (end ? ` to ${(start[i] + length[i]).toFixed(2)} µs` : "");
    }
    return out;
  };
  return new Proxy(made, {get(t, k) {
    if (typeof k === "string" && /^[0-9]+$/.test(k)) { const r = +k; return r < rows ? (t[r] || (t[r] = row(r))) : undefined; }
    return k === "length" ? rows : Reflect.get(t, k);
  }});
}

// The texts go into the full trace as `_cellhover`, an array attribute of its own (listed in _arrayAttrs, which
// plotly.js reads per point into the hover's variables), and nowhere else: after every update the widget
// deep-copies the figure's data and full data (lodash merge) but skips keys that start with "_"; ~120k strings in
// `text` or `hovertext` made a slider step 1.9 s.
function fillHover(gd, table) {
  const cache = gd.__wbCells || (gd.__wbCells = {key: null, texts: null});
  for (const fd of gd._fullData || []) {
    if (!fd || !fd.meta || fd.meta.hover !== "cells") continue;
    Object.defineProperty(fd, "_cellhover", {configurable: true, enumerable: false, get() {
      const cells = table();
      if (!cells || !cells.index) return undefined;
      // the model hands out a fresh copy on every read: the tables' contents are the key, not the object
      const key = [cells.index, cells.name, cells.start, cells.length].map(t => t.bdata).concat(cells.rows).join("|");
      if (cache.key !== key) { cache.key = key; cache.texts = hoverTexts(cells); }
      return cache.texts;
    }});
    if (fd._arrayAttrs && !fd._arrayAttrs.includes("_cellhover")) fd._arrayAttrs.push("_cellhover");
  }
}

// plotly's widget marks each update it applies from Python by setting `_doNotReportToPy` on the data it passes to
// Plotly.update/relayout/restyle, so that its own event handler does not echo the change back. plotly.js takes that
// key for one more attribute, unknown, and replots the whole figure on every update: a Gantt slider step redrew its
// 120k-cell hover heatmap (~130 ms in headless Chromium) to change one image and the title. It also passes an edit
// of an array container's element as plotly.py writes it, "images.0.source", which plotly.js reads as a new
// array (a replot) where "images[0].source" is an edit of one image. Here each message is made right before the
// widget applies it: the element edits written as plotly.js reads them, and the mark put on first as a property
// plotly.js does not enumerate (the widget's own assignment keeps it so). The model hands out a fresh copy of a
// message on every read, so the widget is given this copy. The event of an update from Python no longer carries the
// mark, so its echo is dropped by count instead.
const CALLS = {do_update: ["_py2js_update", "style_data", "handle_plotly_update"],
               do_relayout: ["_py2js_relayout", "relayout_data", "handle_plotly_relayout"],
               do_restyle: ["_py2js_restyle", "restyle_data", "handle_plotly_restyle"]};
const ELEMENT_EDIT = /^(images|shapes|annotations)\\.(\\d+)\\.(.+)$/;

function prepared(msg, name, key, viewID) {
  const layout = msg.layout_data || msg.relayout_data;
  if (layout && typeof layout === "object") {
    for (const k of Object.keys(layout)) {
      const m = ELEMENT_EDIT.exec(k);
      if (m) { layout[`${m[1]}[${m[2]}].${m[3]}`] = layout[k]; delete layout[k]; }
    }
  }
  if (name === "do_relayout" && msg.source_view_id === viewID) return false;    // the widget skips its own
  if (name === "do_update" && (msg[key] === null || msg[key] === undefined)) msg[key] = {};
  const data = msg[key];
  if (!data || typeof data !== "object") return false;
  Object.defineProperty(data, "_doNotReportToPy", {value: true, writable: true, enumerable: false, configurable: true});
  return true;
}

function quietUpdates(View) {
  const proto = View && View.prototype;
  if (!proto || proto.__wbQuiet) return;
  proto.__wbQuiet = true;
  for (const [name, [trait, key, handler]] of Object.entries(CALLS)) {
    const apply = proto[name], handle = proto[handler];
    if (typeof apply !== "function" || typeof handle !== "function") continue;
    proto[name] = function (...args) {
      const model = this.model, msg = model.get(trait);
      if (!msg || typeof msg !== "object") return apply.apply(this, args);
      if (prepared(msg, name, key, this.viewID)) {
        const echo = this.__wbEcho || (this.__wbEcho = {});
        echo[handler] = (echo[handler] || 0) + 1;
      }
      const own = Object.prototype.hasOwnProperty.call(model, "get"), get = model.get;
      model.get = function (k) { return k === trait ? msg : get.apply(this, arguments); };
      try {
        return apply.apply(this, args);
      } finally {
        if (own) model.get = get; else delete model.get;
      }
    };
    proto[handler] = function (...args) {
      const echo = this.__wbEcho;
      if (echo && echo[handler] > 0) { echo[handler]--; return; }
      return handle.apply(this, args);
    };
  }
}

// every update makes the full traces anew
// table: () => the hover table now (the widget's trait; a page without the widget passes its own)
function attach(gd, table) {
  if (gd.__wbHover) return;
  gd.__wbHover = true;
  gd.on("plotly_afterplot", () => fillHover(gd, table));
  fillHover(gd, table);
}

export { attach };    // for a page without the widget (tests, exports) that wants the names too

export default () => {
  let widget, cleanup;
  let loaded;
  return {
    // Not awaited here: anywidget's 2 s from the model's creation run until initialize returns, and plotly's module
    // (the page's one import, which every model of a reloaded page waits on) can take longer on a loaded machine.
    // Its own initialize runs once the module is in; render waits for it.
    initialize(ctx) {
      loaded = plotlyModule(ctx.model).then(async mod => {
        quietUpdates(mod.FigureView);
        widget = mod.default();
        cleanup = await widget.initialize(ctx);
      });
      loaded.catch(e => console.error("[workbench] plotly's widget module failed to load", e));
      return () => loaded.then(() => { if (typeof cleanup === "function") cleanup(); });
    },
    async render(ctx) {
      await loaded;
      const table = () => ctx.model.get("_hover_cells");
      const onRender = e => {
        const gd = e.detail && e.detail.element;
        if (gd && ctx.el.contains(gd)) attach(gd, table);
      };
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
        _hover_cells = traitlets.Dict().tag(sync=True)        # the hover table (the module docstring)

    FigureWidget.__module__ = __name__
    FigureWidget.__qualname__ = "FigureWidget"
    return FigureWidget


def figure_widget(*args, **kw):
    """A FigureWidget (see the module docstring for what differs from plotly's)."""
    return figure_widget_class()(*args, **kw)
