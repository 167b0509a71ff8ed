"""The command line: ``python -m autograph doctor`` and ``python -m autograph bench``, with the
timing helpers the benchmarks share.

May import: ``autograph``'s public names only (it is a user of the library).
"""
