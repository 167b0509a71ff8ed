"""What a graph is made of: the key of a call, how arguments get in and outputs come back
(the plans), the graph object, and the one recording sequence every graph is made by.

May import: backends, distributed, watch and the shared leaves; never the engine, the
policies, buckets, training or the front door.
"""
