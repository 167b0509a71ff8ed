"""Which keys a test's calls warm up watched, op by op."""

from autograph.engine._key_life import KeyLife


def watched_warmups(monkeypatch, of=lambda life: life.label):
    """A list that gets ``of(life)`` for each watched warmup while the test runs.

    >>> watched = watched_warmups(monkeypatch)
    >>> f(x); f(x)
    >>> assert len(watched) == 1
    """
    seen = []
    original = KeyLife.watched_warmup

    def counted(life, c):
        seen.append(of(life))
        return original(life, c)

    monkeypatch.setattr(KeyLife, "watched_warmup", counted)
    return seen
