"""The Jinja templates of the generated files, and the modules those files import.

A generated module beside the generated files with the name of one of these
would be imported in its place (the script's folder is first on
``sys.path``), so no model may generate one (``frontend.namespace``).
``tests/compiler/codegen/test_generated_imports.py`` keeps both lists true: every import
statement of each template and of every generated file of the examples
names a module of :data:`IMPORTS` (or the standard library, the model's own
modules or the spec's user modules), and importing them all loads no public
top-level module outside :data:`IMPORTS` and :data:`LOADED`.
"""

#: Top-level modules the generated files import themselves: the model
#: (torch), the training script and pipeline program (the output folder's
#: ``mpgen_runtime``, which imports numpy, safetensors, tqdm; tensorboard
#: through ``torch.utils.tensorboard``), the tests (pytest, ``mpgen.testing``).
IMPORTS = frozenset({"torch", "numpy", "safetensors", "tqdm", "pytest", "mpgen",
                     "mpgen_runtime"})

#: Top-level modules those load in turn (torch's, pytest's and TensorBoard's
#: dependencies, eagerly or on first use), and ``conftest``, which pytest
#: loads from the folder it collects.
LOADED = frozenset({
    "torchgen", "functorch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
    "filelock", "fsspec", "typing_extensions", "setuptools", "pkg_resources", "cython_runtime",
    "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments", "conftest",
    "tensorboard", "google", "absl", "grpc", "PIL", "werkzeug", "markdown", "six",
    "cuda",  # cuda-bindings, which a CUDA build of torch (PyPI's 2.14) imports
})
