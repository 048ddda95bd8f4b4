"""Show the package's own source in a notebook, highlighted, so no chapter retypes code."""
from __future__ import annotations

import inspect
import textwrap


def source(obj, language: str = "python"):
    """The source of a function, class, method or module, as a highlighted IPython ``Code``.

    Falls back to plain text when IPython is not installed.
    """
    if isinstance(obj, property):
        obj = obj.fget
    text = textwrap.dedent(inspect.getsource(obj))
    try:
        from IPython.display import Code
    except ImportError:  # pragma: no cover - IPython comes with Jupyter
        return text
    return Code(text, language=language)


def code(text: str, language: str = "cuda"):
    """A string of source (for example a kernel's CUDA C) as a highlighted IPython ``Code``."""
    try:
        from IPython.display import Code
    except ImportError:  # pragma: no cover
        return text
    return Code(textwrap.dedent(text).strip("\n"), language=language)
