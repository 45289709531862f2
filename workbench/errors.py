"""The errors that are the user's to fix, as opposed to bugs of the workbench.

A `UserError` is something given to the workbench (an argument, a config.json, a checkpoint, the machine it runs on)
that it cannot use. The command line reports one as a single line, `error: <message>`, and exits with code 2, so the
message must stand alone: it names the argument, file, key or tensor at fault. Any other exception is a bug and keeps
its traceback.

They derive from ValueError so that code which caught ValueError before these existed still catches them.
"""
from __future__ import annotations


class UserError(ValueError):
    """Something the user gave that cannot be used; the message names what and why."""


class UsageError(UserError):
    """A command-line argument out of range, malformed, or not fitting the model (e.g. a prompt id past the vocab)."""


class ConfigError(UserError):
    """A config that the monokernel cannot run, with the reason."""


class WeightsError(UserError):
    """Missing, malformed or mis-shaped weights, with the file and tensor named."""


class NoDeviceError(UserError):
    """A command that needs a GPU on a machine where none is visible."""


class GpuMemoryError(UserError):
    """The model at the asked context does not fit the GPU's memory; the message says what it needs, by part, and
    the longest context that fits."""


class SourceError(UserError):
    """A kernel source the workbench will not read or write as it stands, with the file and the fix named: a section
    file or history entry that is not UTF-8 or holds a NUL byte, an edit's text that holds one, an edit refused
    because the file changed since the text it was based on was read, or a workspace or history folder that cannot
    be one. `path` is the file or folder at fault; `kept`, where the refused text of an edit was saved."""

    def __init__(self, message: str, *, path=None, kept=None):
        super().__init__(message)
        self.path, self.kept = path, kept


class NonFiniteError(UserError):
    """NaN or inf where a choice would be made from it (a prefill's last logits, whose first largest is the first
    token): nothing is chosen. The usual cause is in what was given: weights holding NaN, or an edited stage."""
