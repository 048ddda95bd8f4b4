"""Solutions to the book's coding exercises: real code, shown on the page and tested in CI.

How a chapter's exercises are written (every chapter follows this):

* **One module per chapter**, ``solutions/chNN.py``, NN being the two digits that start the
  chapter's notebook name (``book/01_why_paging.ipynb`` -> ``solutions/ch01.py``). It lists its
  solutions in ``__all__``.
* **Every solution has a check.** A solution ``name`` (a function or a class) comes with a
  function ``check_name(impl=name)`` in the same module that exercises ``impl`` and raises
  ``AssertionError`` if it is wrong. A check compares against a trivially correct oracle (a
  brute-force loop, a slot-by-slot model) or against hand-worked cases, with fixed seeds that it
  names in its failure message (``solutions._seeds.names_its_seed``); it prints nothing, and
  returns the counts the notebook's sentence about it needs (a small dict). It must be able to
  fail:
* **Wrong answers prove the check.** The module's ``WRONG`` dict maps a solution's name to a list
  of plausible wrong implementations (an off-by-one, first fit where best fit was asked, ...);
  the tests assert that the check rejects every one of them.
* **The notebook.** An exercise is a ``{exercise}`` directive with a label (``ex-ch01-best-fit``);
  its solution is the gated ``{solution-start} ex-ch01-best-fit`` ... ``{solution-end}`` pair with
  ``:class: dropdown`` (closed until clicked), so code cells can sit between the two markers.
  Inside, a code cell shows the solution with ``pagedkv.display.source(solutions.chNN.name)``,
  and the next one runs ``solutions.chNN.check_name()`` (and any measurement the exercise asks
  for). Conceptual exercises have a prose solution and nothing here.
* **The tests.** ``tests/test_solutions.py`` imports every ``solutions/ch*.py``, runs every
  ``check_*`` function, runs each check against each ``WRONG`` entry expecting a failure, and
  fails if a name in ``__all__`` has no check. A new chapter's module is picked up without
  touching the test.

The package is installed with ``pagedkv`` (``pip install -e .``), so ``import solutions`` works
in the book build, under nbval and in JupyterLab alike.
"""
