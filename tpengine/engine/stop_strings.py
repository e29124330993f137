"""Stop strings matched as a completion's text grows, in time per step proportional to the new text.

Each stop string is matched by Knuth-Morris-Pratt: a completion keeps, per stop string, how many of
its first characters the text now ends with. That number is both the matcher's state and how much
of the text a stop string might still claim (the tail held back from a stream). The failure tables
are shared by a request's completions and built only as far as some text's match has reached, so
memory stays linear in the stop strings (and in what was matched), whatever their length.
"""
from array import array


class StopStrings:
    """One request's stop strings, with each one's KMP failure table (built lazily, shared)."""

    __slots__ = ("strings", "_borders")

    def __init__(self, strings: tuple[str, ...]):
        self.strings = strings
        # _borders[i][k]: the longest proper prefix of strings[i][:k] that is also its suffix, for k so far
        self._borders = [array("l", [0, 0]) for _ in strings]

    def border(self, i: int, k: int) -> int:
        """The failure link of state k of stop string i (extends its table up to k first)."""
        borders = self._borders[i]
        if k >= len(borders):
            stop = self.strings[i]
            for j in range(len(borders), k + 1):
                q, c = borders[j - 1], stop[j - 1]
                while q and stop[q] != c:
                    q = borders[q]
                borders.append(q + 1 if stop[q] == c else q)
        return borders[k]


class StopMatcher:
    """One completion's progress through its request's stop strings."""

    __slots__ = ("stops", "states")

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.states = [0] * len(stops.strings)   # per stop string: its first characters the text ends with

    @property
    def num_held_back(self) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        return max(self.states)

    def feed(self, text: str, start: int, report: bool) -> tuple[str, int] | None:
        """Advance over text[start:] (the characters new since the last call). With report, returns the
        stop string completed in them that starts earliest (the first listed among equals) and where
        it starts; without (min_tokens not reached), matches only advance the states."""
        stops, states = self.stops, self.states
        best: tuple[str, int] | None = None
        for i, stop in enumerate(stops.strings):
            q = states[i]
            if q == 0 and text.find(stop[0], start) == -1:
                continue  # the common step: one C search, no character walk
            length = len(stop)
            for at in range(start, len(text)):
                c = text[at]
                while q and stop[q] != c:
                    q = stops.border(i, q)
                if stop[q] == c:
                    q += 1
                if q == length:
                    found_at = at + 1 - length
                    if report and (best is None or found_at < best[1]):
                        best = (stop, found_at)
                    q = stops.border(i, q)
                    if report:
                        break  # a later match of the same string starts later
            states[i] = q
        return best
