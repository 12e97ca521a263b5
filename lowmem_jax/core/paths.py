"""Output paths checked before any work: a run that cannot write its results fails at once, in one
line naming the parameter, not after the data is loaded and the step compiled."""

from __future__ import annotations

import os

__all__ = ["ensure_directory", "check_writable_file"]


def ensure_directory(path: str | os.PathLike, label: str) -> str:
    """Creates directory ``path`` if missing; returns its absolute path.

    Raises:
      NotADirectoryError: ``path`` is a file.
      PermissionError: it cannot be created or written.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{label}={path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"{label}={path} cannot be created ({err.strerror or err})") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{label}={path} is not writable")
    return path


def check_writable_file(path: str | os.PathLike, label: str) -> None:
    """Checks that file ``path`` can be written (its directory exists and is writable).

    Raises:
      IsADirectoryError, FileNotFoundError, PermissionError: naming ``label``.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{label}={path} is a directory, not a file")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        # The nearest existing ancestor says why: a file where a directory should be, or none.
        ancestor = parent
        while ancestor and not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if ancestor and not os.path.isdir(ancestor):
            raise NotADirectoryError(f"{label}={path}: {ancestor} is a file, not a directory")
        raise FileNotFoundError(f"{label}={path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{label}={path} cannot be written ({parent} is not writable)")
