"""The watchers: what a capture may assume, learnt while a call runs.

The guard and its unsafe-op catalogue, the dispatch modes they share, state read by address
and the slots it lives in, Python state a call reads or changes, numbers computed from a
batch size, host calls, and the undo of a warmup's effects.

May import: only the shared leaves. Watchers never import the engine, the front door, the
backends or anything that decides what to do with what they find.
"""
