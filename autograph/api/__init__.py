"""The front door: what a user calls.

``graphed`` (functions, methods, modules), ``region``, ``capture()`` ahead of time with
``per_bucket``, and ``report``/``stats``/``reset``. Everything here is reached through
``autograph``'s own names; these modules are private.

May import: the engine and every package below it (docs/design.md, "Layers").
"""
