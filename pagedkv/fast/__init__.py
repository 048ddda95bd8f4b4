"""The bookkeeping made fast: the same API as :mod:`pagedkv.allocator` and :mod:`pagedkv.manager`.

(Moved here unchanged from the teaching modules; being adapted to the teaching core's semantics.)
"""
