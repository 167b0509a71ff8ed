"""The engine of one graphed function, method, module or region module.

It routes each call to its key's life (warmup, capture, replay, eager), keeps the bounded key
cache and the last-key fast path. It owns no watching and no policy of its own: it asks the
watchers what a capture may assume and the policies whether a graph is worth keeping.

May import: buckets, training, policy, capture, backends, distributed, watch and the shared
leaves; never the front door (api) or the command line.
"""
