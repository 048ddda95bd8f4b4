"""Typed errors. Every error the package raises on purpose derives from :class:`PagedKVError`.

Running out of blocks (:class:`OutOfBlocks`) is an ordinary outcome that callers test for (or
avoid with the ``can_*`` predicates); the others mean the caller asked for something impossible.
An operation that raises has changed nothing.
"""


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class BackendError(PagedKVError):
    """The requested array backend cannot be used."""


class ConfigError(PagedKVError, ValueError):
    """A size, shape or dtype that cannot work (zero blocks, a pool smaller than one block...)."""


class OutOfBlocks(PagedKVError):
    """Not enough free blocks for the whole request; nothing was allocated."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = int(needed), int(free)
        super().__init__(f"{what + ': ' if what else ''}needs {self.needed} free block(s), "
                         f"only {self.free} free")


class InvalidBlock(PagedKVError, IndexError):
    """A block id outside the pool, or one that is not in the state the operation needs."""


class DoubleFree(InvalidBlock):
    """A block freed (or released) when it was already free."""


class UnknownSequence(PagedKVError, KeyError):
    """A sequence id the manager does not hold."""

    def __str__(self):  # KeyError would print only the repr of its argument
        return str(self.args[0]) if self.args else ""


class SequenceExists(PagedKVError, ValueError):
    """A sequence id that is already registered (add, or fork onto an existing id)."""


class TokenIndexError(PagedKVError, IndexError):
    """A token position outside a sequence."""
