"""Admission: which computed chunks are worth a slot.

``second_sight`` admits a chunk only when its key was offered before, within the last
``memory`` distinct keys: a prefix is saved from its second use on, so one-off prompts never
push out chunks that come back.

``would_admit(key)`` is ``admit(key)``'s answer if it were asked now, changing nothing: the
scheduler decides a step's saves with it before it reserves them, then asks ``admit`` of each
chunk in its turn (:meth:`kvtier.scheduler.OffloadScheduler.plan_saves`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class AdmitAll:
    def admit(self, key: Hashable) -> bool:
        return True

    def would_admit(self, key: Hashable) -> bool:
        return True


class SecondSight:
    def __init__(self, memory: int) -> None:
        self.memory = memory
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    def would_admit(self, key: Hashable) -> bool:
        return key in self._seen

    def admit(self, key: Hashable) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > self.memory:
            self._seen.popitem(last=False)
        return False
