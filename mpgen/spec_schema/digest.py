"""The digest of what a spec means: the ``# spec digest:`` line of every
generated file.

# NOTE: [Spec digest]
# A generated file records the digest of its spec so that a reader (and a
# later ``mpgen check`` that skips unchanged specs) can tell whether the spec
# changed. It covers the spec's meaning, not its bytes: the validated model
# (``models.Spec``), dumped as JSON. So comments, blank lines, quoting, flow
# or block style, a number's spelling (``3e-4`` or ``0.0003``), the short
# forms the models normalise (``in: x`` for ``in: [x]``, ``loss: MSELoss``
# for ``{op: MSELoss}``), a default written out or left out, and the order
# of a model's own keys (``name``/``layers``/``train``, ``op``/``args`` in a
# layer) do not change it. Keys are NOT sorted: the order within a mapping
# of names is meaning (``layers`` is forward's order, ``inputs`` is its
# signature, a layer's keyword arguments are written in spec order), and the
# mappings whose order is not meaning (``placement``, ``capacity``) are kept
# in order too, since a false "changed" costs a rebuild and a false "same"
# would hide a change. JSON keeps what YAML tells apart: ``1``, ``1.0``,
# ``true`` and ``"1"`` differ; ``inf`` and ``nan`` are written as JSON's
# ``Infinity``/``NaN``, not ``null`` (pydantic's JSON mode would conflate them).
#
# It needs only the spec language (YAML + pydantic), never torch or the
# compiler: :func:`file_digest` is what a torch-free ``mpgen check`` of
# unchanged specs computes. The digest alone does not determine the
# generated files; a cache of builds must key on it together with the
# spec's path as headers show it (``display_path``), the mpgen version (the
# models, their defaults and this dump are mpgen's, and the code generators
# too), the torch version (signatures, shapes and parameter counts are
# torch's), the device map, and the sources of any user modules the spec
# imports (their classes are run to infer shapes).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mpgen.files import is_project_folder

if TYPE_CHECKING:  # imported where used: display_path serves check's fast path (no pydantic)
    from mpgen.spec_schema.models import Spec

#: The hash function, named in every digest (``sha256:<hex>``).
ALGORITHM = "sha256"


def canonical(spec: Spec) -> bytes:
    """The spec's meaning as bytes: the validated model as compact JSON, its
    mappings in the order the models and the spec give them (NOTE [Spec digest])."""
    data = spec.model_dump(mode="python", by_alias=True)
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"),
                      allow_nan=True).encode("ascii")


def spec_digest(spec: Spec) -> str:
    """``sha256:<hex>`` of :func:`canonical`: equal for two specs that mean the
    same, different for any change of meaning."""
    return f"{ALGORITHM}:{hashlib.new(ALGORITHM, canonical(spec)).hexdigest()}"


def display_path(spec_path: str | Path) -> str:
    """The spec path shown in generated headers: stable across directories.

    Relative to the enclosing project (the nearest folder above the spec with
    ``.git`` or ``pyproject.toml``), else the file name, so that building from
    another directory, or with an absolute path, gives the same bytes. Like
    the digest it needs no torch: ``mpgen check`` matches a spec to its
    manifest entry and its files' headers by it.
    """
    path = Path(os.path.abspath(spec_path))
    shown = path.name
    for parent in path.parents:
        if is_project_folder(parent):
            shown = path.relative_to(parent).as_posix()
            break
    # It lands in comments and docstrings: escape anything unusual.
    return shown.encode("unicode_escape").decode("ascii").replace('"', '\\"')


def file_digest(path: str | Path) -> str:
    """The digest of the spec file at ``path`` (loaded and validated, without
    torch); an :class:`~mpgen.errors.MpgenError` for a spec that is not valid."""
    from mpgen.spec_schema.load import load_file
    from mpgen.spec_schema.validate import validate

    return spec_digest(validate(load_file(path)))
