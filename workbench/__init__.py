"""workbench: batch-1 LLM decode monokernels (see README.md). Importing the package imports nothing heavy."""


def load_ipython_extension(ipython):
    """`%load_ext workbench`: the %%section and %wb_undo magics of the editing loop (workbench.magic)."""
    from .loop.magic import load_ipython_extension as load   # IPython: only a notebook loads the magics
    load(ipython)
