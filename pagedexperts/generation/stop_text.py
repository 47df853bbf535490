"""Stop strings and the text a reader may see as tokens arrive: one rule for every path
(``generate``, ``generate --speculative`` and the server), OpenAI's: generation ends at the
first stop string, which is not returned (nor anything after it).

Owns ``stop_cut`` (the part of a decode that may be shown) and ``IncrementalText`` (the text
shown so far, grown one decode at a time). An incomplete UTF-8 character decodes as U+FFFD
until its last byte arrives; text is held back until its characters are complete AND cannot be
the start of a stop string, so a stop string is never shown, not even in part.
Does not: decide when to stop generating (transformers' ``StopStringCriteria`` in
``generation``, the scheduler in ``engine``), or tokenize.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


def stop_cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """(the part of ``text`` that may be shown, whether a stop string ended it).

    With a stop string in ``text``: everything before its first occurrence, True. Otherwise
    the text without (1) trailing incomplete characters (U+FFFD at the end) and (2) the
    longest tail of the remaining complete text that is a proper prefix of some stop string
    (it may still become one), False. The hold-back looks at complete text only: a partial
    character after "界 " must not hide that "界 " starts the stop "界 😀".
    """
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], True
    complete = text.rstrip(REPLACEMENT_CHAR)
    keep = len(complete)
    for s in stops:
        for n in range(min(len(s) - 1, len(complete)), 0, -1):
            if complete.endswith(s[:n]):
                keep = min(keep, len(complete) - n)
                break
    return text[:keep], False


@dataclass
class IncrementalText:
    """The text a client has been shown, grown one decode at a time.

    ``update(text, complete)`` takes the decode of ALL generated tokens so far and returns
    (new text to send, whether a stop string was reached). ``complete`` = the sequence ended
    for another reason (end of sequence, length): nothing is held back any more, except
    that a stop string still cuts. The shown text is always a prefix of the final text.
    """

    stops: tuple[str, ...]
    shown_chars: int = 0

    def update(self, text: str, complete: bool) -> tuple[str, bool]:
        visible, stopped = stop_cut(text, self.stops)
        if complete and not stopped:
            visible = text
        delta = visible[self.shown_chars:] if len(visible) > self.shown_chars else ""
        self.shown_chars += len(delta)
        return delta, stopped
