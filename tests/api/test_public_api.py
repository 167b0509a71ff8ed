"""What ``import autograph`` shows a user: the public names only, each documented."""

import dataclasses
import pydoc

import autograph
from autograph._config import Options


def test_dir_shows_only_the_public_names():
    names = dir(autograph)
    assert names == sorted([*autograph.__all__, "__version__"])
    assert "Any" not in names and not hasattr(autograph, "Any")
    assert not {"api", "engine", "backends", "watch", "typing"} & set(names)
    assert all(getattr(autograph, name) is not None for name in names)


def test_help_of_graphed_documents_every_option():
    text = pydoc.render_doc(autograph.graphed, renderer=pydoc.plaintext)
    missing = [f.name for f in dataclasses.fields(Options) if f"``{f.name}" not in text]
    assert missing == []
    assert "bucket_outputs=0" in text


def test_every_public_function_class_and_module_has_its_own_docstring():
    # What the API reference (docs/reference.md) is generated from.
    for name in autograph.__all__:
        obj = getattr(autograph, name)
        if isinstance(obj, dict):  # VERIFY_TOLERANCES: a table, documented in the guides
            continue
        assert (obj.__doc__ or "").strip(), f"autograph.{name} has no docstring"
