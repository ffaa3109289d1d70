"""The output folder: what a build leaves there and how ``check`` compares it.

:mod:`~mpgen.output.write` surveys the folder (every file accounted for:
ours, a stranger, an orphan), writes the generated files as one unit, and
diffs them for ``check``; ``--prune`` removes a deleted spec's orphans.
:mod:`~mpgen.output.manifest` is the build manifest (NOTE [Build manifest]):
per output folder and spec, the key of its build and its files' sha256, so a
current spec is not compiled. Above the compiler in the layering
(``tests/test_layering.py``): it may import ``mpgen.compiler``, which never
imports it. Neither module imports torch, pydantic or black.
"""
