"""Typed errors. Every error the package raises on purpose derives from :class:`PagedKVError`.

Running out of blocks (:class:`OutOfBlocks`) is an ordinary outcome that callers test for (or
avoid with the ``can_*`` predicates); the others mean the caller asked for something impossible.
An operation that raises has changed nothing.

One rule for the names: the error says what happened, not where.

==========================  ==================================================================
:class:`ConfigError`        a size, count, shape or dtype that cannot work
:class:`OutOfBlocks`        too few free blocks for the whole request
:class:`PoolTooLarge`       the device (or host) could not give the pool's memory
:class:`AllocatorClosed`    use of an allocator after ``close()``
:class:`InvalidBlock`       a block id that is not a block of the pool, or not in use
:class:`DoubleFree`         a block (or range) given back when it was already free
:class:`UnknownSequence`    a sequence id the manager does not hold
:class:`SequenceExists`     a new sequence id that is already live
:class:`DuplicateSequence`  one sequence named twice in one call (a step, a fork)
:class:`TokenIndexError`    a token position outside a sequence
:class:`AuditError`         the invariant audit found corrupted state
:class:`BackendError`       the requested array backend cannot be used
==========================  ==================================================================
"""


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class BackendError(PagedKVError):
    """The requested array backend cannot be used."""


class ConfigError(PagedKVError, ValueError):
    """A size, count, shape or dtype that cannot work (zero blocks, a negative count...)."""


class OutOfBlocks(PagedKVError):
    """Not enough free blocks for the whole request; nothing was allocated."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = int(needed), int(free)
        super().__init__(f"{what + ': ' if what else ''}needs {self.needed} free block(s), "
                         f"only {self.free} free")


class PoolTooLarge(PagedKVError, MemoryError):
    """The memory for the pool could not be claimed."""


class AllocatorClosed(PagedKVError):
    """The allocator was closed: its pool has been given back."""


class InvalidBlock(PagedKVError, IndexError):
    """A block id outside the pool, not an integer, or not in the state the operation needs."""


class DoubleFree(InvalidBlock):
    """A block freed (or a range given back) when it was already free."""


class UnknownSequence(PagedKVError, KeyError):
    """A sequence id the manager does not hold."""

    def __str__(self):  # KeyError would print only the repr of its argument
        return str(self.args[0]) if self.args else ""


class SequenceExists(PagedKVError, ValueError):
    """A new sequence id (add, or a fork's child) that is already live."""


class DuplicateSequence(PagedKVError, ValueError):
    """The same sequence id named twice in one call (a step's batch, a fork's children)."""


class TokenIndexError(PagedKVError, IndexError):
    """A token position outside a sequence."""


class AuditError(PagedKVError):
    """An invariant does not hold. Raised by ``audit()`` (never an ``assert``, so that it also
    works under ``python -O``); the message names the invariant."""
