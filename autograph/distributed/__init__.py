"""Several processes: every rank makes the same graph-or-eager decision for a key whose calls
run collectives.

May import: watch and the shared leaves.
"""
