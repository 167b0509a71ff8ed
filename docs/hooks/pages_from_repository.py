"""An mkdocs hook: pages the site shows from files kept elsewhere in the repository.

>>> mkdocs build --strict        # mkdocs.yml names this file under ``hooks:``

The changelog and the benchmark results live where their tools expect them (CHANGELOG.md at
the top, benchmarks/RESULTS.md and its chart written by benchmarks/run.py); the site reads
them from there, so there is no copy to fall out of date.
"""
import os

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# page on the site: file in the repository
PAGES = {
    "changelog.md": "CHANGELOG.md",
    "benchmarks.md": os.path.join("benchmarks", "RESULTS.md"),
    "results.png": os.path.join("benchmarks", "results.png"),  # RESULTS.md's chart
}


def on_files(files, config):
    for uri, path in PAGES.items():
        files.append(File.generated(config, uri, abs_src_path=os.path.join(ROOT, path)))
    return files
