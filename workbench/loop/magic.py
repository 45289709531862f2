"""IPython magics for the editing loop: `%load_ext workbench`, then

    %%section NAME [--variant V] [--no-reload]
    <the whole section file>

writes the cell into kernels/sections/NAME.cuh (or NAME@V.cuh, which the build then uses; NAME@ptx....ptx for a
stage's body in PTX, workbench.compiler.ptx) through the active
Workbench (atomically, the previous version kept for undo), and reloads: compile, verify every stage, time.
`%wb_undo NAME [--variant V] [--no-reload]` puts the previous version back. Errors are printed as file:line with
the source line, never as a traceback; a failed write leaves the old file in place (the cell keeps your text).
"""
from __future__ import annotations

import argparse
import shlex

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from . import sections, session


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):                    # never SystemExit inside a notebook
        raise _Usage(f"{message}\nusage: {self.format_usage().strip().removeprefix('usage: ')}")


def _parser(prog: str) -> _Parser:
    p = _Parser(prog=prog, add_help=False)
    p.add_argument("name", help="section name (kernels/sections/NAME.cuh) or monokernel")
    p.add_argument("--variant", "-v", default=None,
                   help="kernels/sections/NAME@VARIANT.cuh (NAME@VARIANT.ptx for a variant named ptx...)")
    p.add_argument("--no-reload", action="store_true", help="write only")
    return p


def _target_or_report(prog: str, line: str, consequence: str = ""):
    """The magic's arguments and the section file they name; bad input (a usage error, unbalanced quotes, an unknown
    section) printed, and None returned, instead of raised into the notebook."""
    try:
        args = _parser(prog).parse_args(shlex.split(line))
        return args, sections.section_file(args.name, args.variant)
    except (_Usage, ValueError) as e:            # shlex: unbalanced quotes; section_file: no such section
        print(f"✗ {prog}: {e}" + (f"\n{consequence}" if consequence else ""))
        return None


@magics_class
class WorkbenchMagics(Magics):
    @cell_magic
    def section(self, line: str, cell: str):
        """%%section NAME [--variant V] [--no-reload]: the cell becomes the section file; then reload."""
        target = _target_or_report("%%section", line, "nothing was written")
        if target is None:
            return
        args, path = target
        wb = session.active()
        shown = sections.display_path(path)
        try:
            entry = (wb.edit(args.name, cell, args.variant) if wb is not None
                     else sections.write_section(args.name, cell, args.variant))
        except Exception as e:                   # noqa: BLE001 - reported, never raised into the notebook
            print(f"✗ could not write {shown}: {type(e).__name__}: {e}\n"
                  f"  the file on disk is unchanged; your text is still in this cell")
            return
        if entry is None:
            print(f"{shown}: unchanged")
        else:
            undo = f"%wb_undo {args.name}" + (f" --variant {args.variant}" if args.variant else "")
            print(f"wrote {shown} (the previous version is kept: {undo})")
        if wb is None:
            print(f"no active Workbench to reload it: {session.HOW_TO_CREATE}")
            return
        if args.no_reload:
            return
        current = wb.variants.get(args.name)
        if args.variant and current != args.variant:
            wb.variants[args.name] = args.variant
            print(f"building {args.name} from {shown} from now on (wb.use_variant({args.name!r}, None) goes back)")
        elif not args.variant and current:
            print(f"note: the build uses {args.name}@{current}, not the file just written "
                  f"(wb.use_variant({args.name!r}, None) switches to it)")
        self._reload(wb, trigger="magic", section=args.name, variant=args.variant)

    @line_magic
    def wb_undo(self, line: str):
        """%wb_undo NAME [--variant V] [--no-reload]: restore the section's previous version; then reload."""
        target = _target_or_report("%wb_undo", line)
        if target is None:
            return
        args, path = target
        wb = session.active()
        try:
            if wb is not None:
                wb.undo(args.name, args.variant, reload=False)
            else:
                sections.undo_section(args.name, args.variant)
        except LookupError as e:
            print(f"✗ {e}")
            return
        except Exception as e:                   # noqa: BLE001
            print(f"✗ could not restore {sections.display_path(path)}: {type(e).__name__}: {e}")
            return
        print(f"restored the previous version of {sections.display_path(path)}")
        if wb is None:
            print(f"no active Workbench to reload it: {session.HOW_TO_CREATE}")
        elif not args.no_reload:
            self._reload(wb, trigger="undo", section=args.name, variant=args.variant)

    @staticmethod
    def _reload(wb, **kw):
        def early(rec):                          # the verdict, while the timed build may still compile
            if rec.passed is not None:
                print(rec.verdict(), flush=True)
        wb.on_verdict.append(early)
        try:
            rec = wb.reload(**kw)
        except Exception as e:                   # noqa: BLE001
            print(f"✗ reload failed: {type(e).__name__}: {e}")
            return
        finally:
            wb.on_verdict.remove(early)
        print(rec.report())


def load_ipython_extension(ipython):
    ipython.register_magics(WorkbenchMagics)
