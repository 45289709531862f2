# JupyterLab started with this folder on JUPYTER_CONFIG_PATH (`JUPYTER_CONFIG_PATH=jupyter_config jupyter lab` from
# the repository root) saves the notebooks of notebooks/ without outputs, so that running them leaves git clean
# (workbench/nbclean.py says why and what else does).
import sys
from pathlib import Path

root = str(Path(__file__).resolve().parent.parent)
if root not in sys.path:                            # the workbench importable from a checkout, installed or not
    sys.path.insert(0, root)

c.ContentsManager.pre_save_hook = "workbench.nbclean.pre_save_hook"  # noqa: F821 (traitlets' config object)
# no "notified about official Jupyter news?" toast: it sits over the bottom right of the dashboards' charts (their
# legends) until dismissed
c.LabApp.news_url = None  # noqa: F821
