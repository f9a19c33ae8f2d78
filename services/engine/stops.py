"""Stop strings over a token stream: text that could still become a stop string is
held back until it cannot; the stop string itself is never emitted."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self.stopped = False

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for (without one, feed returns its text)."""
        return bool(self._stops)

    def feed(self, text: str) -> str:
        """Adds generated text; returns the part that is now final. After a stop
        string is seen, ``stopped`` is set and everything from it on is dropped."""
        if not self._stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        keep = self._held_suffix(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that begins some stop string."""
        for n in range(min(self._hold - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
