# JupyterLab started with this folder on JUPYTER_CONFIG_PATH (`JUPYTER_CONFIG_PATH=jupyter_config jupyter lab` from
# the repository root) saves the notebooks of notebooks/ without outputs, so that running them leaves git clean
# (workbench/nbclean.py says why and what else does).
import sys
from pathlib import Path

root = str(Path(__file__).resolve().parent.parent)
if root not in sys.path:                            # the workbench importable from a checkout, installed or not
    sys.path.insert(0, root)

c.ContentsManager.pre_save_hook = "workbench.nbclean.pre_save_hook"  # noqa: F821 (traitlets' config object)
# no news fetched. JupyterLab 4.6 still asks once whether to be "notified about official Jupyter news?", in a toast
# over the bottom right of the page (the dashboards' legends) until answered; the answer is a user setting (Settings
# → Notifications, "fetchNews"), which the browser tests set to "false" in their own settings folder
c.LabApp.news_url = None  # noqa: F821
