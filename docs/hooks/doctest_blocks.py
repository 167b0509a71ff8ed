"""A griffe extension for the API reference: the docstrings' ``>>>`` examples shown as code.

>>> mkdocs build --strict        # mkdocs.yml lists this file under mkdocstrings' extensions

The package's docstrings open with an example in the interpreter's form (``>>>`` and ``...``
lines), which Markdown would read as nested quotes; this puts each such run of lines in a
Python code block, and leaves the text between them as it is.
"""
import re

import griffe

PROMPT = re.compile(r"^(\s*)(>>>|\.\.\.)( |$)")


def fenced(text: str) -> str:
    out, in_block = [], False
    for line in text.splitlines():
        prompt = PROMPT.match(line)
        if prompt and not in_block:
            out.append(prompt.group(1) + "```pycon")
            in_block = True
        elif not prompt and in_block:
            out.append(out[-1][:len(out[-1]) - len(out[-1].lstrip())] + "```")
            in_block = False
        out.append(line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fenced(obj.docstring.value)
