"""Stop strings and the text a reader may see as tokens arrive: one rule for every path
(``generate``, ``generate --speculative``, the server), OpenAI's: generation ends at the first
stop string, which is not returned (nor anything after it); no part of a stop string is ever
shown (``stop_cut``, ``IncrementalText``). Does not: decide when to stop generating, or tokenize.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


def stop_cut(text: str, stops: tuple[str, ...], *, start: int = 0, include: bool = False) -> tuple[str, bool]:
    """(the part of ``text`` that may be shown, whether a stop string ended it).

    With a stop string in ``text`` ending after character ``start`` (0: anywhere): everything
    before its first such occurrence (``include``: up to its end), True. Otherwise the text
    without (1) trailing incomplete characters (U+FFFD at the end) and (2), unless ``include``,
    the longest tail of the remaining complete text that is a proper prefix of some stop string
    (it may still become one), False. The hold-back looks at complete text only: a partial
    character after "界 " must not hide that "界 " starts the stop "界 😀".
    """
    found = first_stop(text, stops, start=start)
    if found is not None:
        begin, end, _ = found
        return text[:end if include else begin], True
    complete = text.rstrip(REPLACEMENT_CHAR)
    keep = len(complete)
    for s in stops if not include else ():
        for n in range(min(len(s) - 1, len(complete)), 0, -1):
            if complete.endswith(s[:n]):
                keep = min(keep, len(complete) - n)
                break
    return text[:keep], False


def first_stop(text: str, stops: tuple[str, ...], *, start: int = 0) -> tuple[int, int, str] | None:
    """(begin, end, the stop string) of the first stop string in ``text`` ending after character
    ``start`` (the earliest begin; of two beginning there, the shorter), or None."""
    found = [(i, i + len(s), s) for i, s in ((text.find(s, max(0, start - len(s) + 1)), s) for s in stops) if i >= 0]
    return min(found) if found else None


@dataclass
class IncrementalText:
    """The text a client has been shown, grown one decode at a time.

    ``update(text, complete)`` takes the decode of ALL generated tokens so far and returns
    (new text to send, whether a stop string was reached). ``complete`` = the sequence ended
    for another reason (end of sequence, length): nothing is held back any more, except
    that a stop string still cuts. The shown text is always a prefix of the final text.
    ``include``: the stop string is part of the text (vLLM's ``include_stop_str_in_output``).
    ``stop_from``: stop strings ending at or before this character do not count (the caller
    sets it to the complete text of the first min_tokens tokens). ``matched``: the stop string that
    ended the text, once one has (vLLM's ``stop_reason``).
    """

    stops: tuple[str, ...]
    shown_chars: int = 0
    include: bool = False
    stop_from: int = 0
    matched: str | None = None

    def update(self, text: str, complete: bool) -> tuple[str, bool]:
        visible, stopped = stop_cut(text, self.stops, start=self.stop_from, include=self.include)
        if stopped:
            self.matched = first_stop(text, self.stops, start=self.stop_from)[2]
        if complete and not stopped:
            visible = text
        delta = visible[self.shown_chars:] if len(visible) > self.shown_chars else ""
        self.shown_chars += len(delta)
        return delta, stopped
